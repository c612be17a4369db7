"""``--sweep NAME=V1,V2,...``: engine settings (any numeric or on/off ``EngineConfig`` field,
``speculative`` (off / ngram), ``kv_cache_dtype`` (auto / float16 / bfloat16 / float32 / int8 / int4), and
concurrency) to try, and the best of them for the user's SLO."""

from __future__ import annotations

import itertools
from dataclasses import fields
from typing import Any, Mapping, Optional, Sequence

from ..config import EngineConfig

_BOOLEANS = {"true": True, "on": True, "1": True, "false": False, "off": False, "0": False}
# Field types are strings here (the config module uses postponed annotations).
_KINDS = {f.name: "bool" if "bool" in str(f.type) else "number" for f in fields(EngineConfig)
          if any(t in str(f.type) for t in ("int", "float", "bool"))}
_CHOICES = {"speculative": ("off", "ngram"), "kv_cache_dtype": ("auto", "float16", "bfloat16", "float32", "int8", "int4")}
SWEEPABLE = tuple(_KINDS) + tuple(_CHOICES) + ("concurrency",)


def _value(name: str, text: str) -> Any:
    if name in _CHOICES:
        if text not in _CHOICES[name]:
            raise ValueError(text)
        return None if text == "off" else text
    if _KINDS.get(name) == "bool":
        if text.lower() not in _BOOLEANS:
            raise ValueError(text)
        return _BOOLEANS[text.lower()]
    value = float(text)
    return int(value) if value.is_integer() and "." not in text else value


def parse(specs: Sequence[str]) -> tuple[list[dict[str, Any]], Optional[list[int]]]:
    """``["max_num_seqs=8,16", "concurrency=4,8"]`` -> the engine settings to try (every
    combination) and the concurrency levels (None when not swept)."""
    axes: dict[str, list[Any]] = {}
    for spec in specs:
        name, sep, values = spec.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or name not in SWEEPABLE:
            raise ValueError(f"bad --sweep {spec!r}: expected NAME=V1,V2 with NAME one of {', '.join(SWEEPABLE)}")
        try:
            axes[name] = [_value(name, v.strip()) for v in values.split(",") if v.strip()]
        except ValueError:
            raise ValueError(f"bad --sweep {spec!r}: values must be numbers (true/false for a switch, "
                             f"{' or '.join(_CHOICES.get(name, ()))} for {name})" if name in _CHOICES else
                             f"bad --sweep {spec!r}: values must be numbers (or true/false for a switch)") from None
        if not axes[name]:
            raise ValueError(f"bad --sweep {spec!r}: no values")
    concurrency = axes.pop("concurrency", None)
    settings = [dict(zip(axes, combo)) for combo in itertools.product(*axes.values())] or [{}]
    return settings, concurrency


def label(setting: Mapping[str, Any]) -> str:
    """``max_num_seqs=8 max_num_batched_tokens=512``, or ``defaults``."""
    return " ".join(f"{k}={v}" for k, v in setting.items()) or "defaults"


def score(row: Mapping[str, Any]) -> tuple[float, float]:
    """Goodput first (when an SLO was given and measured), then output tok/s."""
    m = row["metrics"]
    return (m["request_goodput"] if m["request_goodput"] is not None else -1.0, m["output_throughput"])


def best(rows: Sequence[Mapping[str, Any]]) -> Optional[Mapping[str, Any]]:
    """The row with the highest :func:`score` (None when there are no rows)."""
    return max(rows, key=score, default=None)
