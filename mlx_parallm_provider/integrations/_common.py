"""What both front doors report the same way: the provider's name and OpenAI's usage dict."""

from __future__ import annotations

from typing import Any, Optional

from ..engine import TokenLogprob, Usage

PROVIDER = "mlx-parallm"


def usage_dict(usage: Usage) -> dict[str, Any]:
    """OpenAI's usage dict: ``prompt_tokens``, ``completion_tokens``, ``total_tokens``,
    ``prompt_tokens_details.cached_tokens`` (prompt tokens whose KV came from the prefix cache)
    and ``completion_tokens_details.reasoning_tokens`` (a reasoning model's thinking)."""
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
    }


def vllm_prompt_logprobs(entries: Optional[list[Optional[TokenLogprob]]]) -> Optional[list[Optional[dict[int, dict[str, Any]]]]]:
    """vLLM's ``prompt_logprobs``: for each prompt token, None (the first) or ``{token id:
    {"logprob", "rank", "decoded_token"}}`` for the token and its top alternatives."""
    if entries is None:
        return None
    out: list[Optional[dict[int, dict[str, Any]]]] = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        ranked = {entry.token_id: {"logprob": entry.logprob, "rank": entry.rank, "decoded_token": entry.token}}
        for place, (token_id, text, logprob) in enumerate(entry.top_logprobs, start=1):
            ranked.setdefault(token_id, {"logprob": logprob, "rank": place, "decoded_token": text})
        out.append(ranked)
    return out
