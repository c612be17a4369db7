"""What both front doors report the same way: the provider's name and OpenAI's usage dict."""

from __future__ import annotations

from ..engine import Usage

PROVIDER = "mlx-parallm"


def usage_dict(usage: Usage) -> dict[str, int]:
    """OpenAI's usage dict: ``prompt_tokens``, ``completion_tokens``, ``total_tokens``."""
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens, "total_tokens": usage.total_tokens}
