"""What both front doors report the same way: the provider's name and OpenAI's usage dict."""

from __future__ import annotations

from typing import Any

from ..engine import Usage

PROVIDER = "mlx-parallm"


def usage_dict(usage: Usage) -> dict[str, Any]:
    """OpenAI's usage dict: ``prompt_tokens``, ``completion_tokens``, ``total_tokens`` and
    ``prompt_tokens_details.cached_tokens`` (prompt tokens whose KV came from the prefix cache)."""
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }
