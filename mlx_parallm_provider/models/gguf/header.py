"""Typed, validated reads of a GGUF file's ``<architecture>.*`` metadata."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ...errors import ModelLoadError


class Header:
    """The metadata of one file, read under its architecture's prefix (``llama.block_count``).

    Every bad value is a ModelLoadError naming the key: ``invalid GGUF header: llama.x = 0``.
    """

    def __init__(self, path: Path, metadata: dict[str, Any], arch: str) -> None:
        self.path, self.metadata, self.arch = path, metadata, arch

    def raw(self, key: str, default: Any = None) -> Any:
        """The value of ``<arch>.<key>`` as stored, or ``default``."""
        value = self.metadata.get(f"{self.arch}.{key}", default)
        return value.item() if hasattr(value, "item") and getattr(value, "ndim", 1) == 0 else value

    def need(self, key: str) -> Any:
        value = self.raw(key)
        if value is None:
            raise ModelLoadError(f"{self.path}: GGUF metadata lacks {self.arch}.{key}")
        return value

    def count(self, key: str, default: Any = None) -> int:
        """A positive integer (a head count of 0 would divide by zero later)."""
        value = self.need(key) if default is None else self.raw(key, default)
        number = self.number(key, value, int)
        if number <= 0:
            self.invalid(f"{self.arch}.{key} = {number}, must be a positive integer")
        return number

    def real(self, key: str, default: float) -> float:
        """A positive finite number."""
        number = self.number(key, self.raw(key, default), float)
        if not math.isfinite(number) or number <= 0:
            self.invalid(f"{self.arch}.{key} = {number}, must be a positive number")
        return number

    def number(self, key: str, value: Any, kind: type) -> Any:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
            self.invalid(f"{self.arch}.{key} = {value!r}, must be a {'whole ' if kind is int else ''}number")
        return kind(value)

    def invalid(self, reason: str) -> None:
        raise ModelLoadError(f"{self.path}: invalid GGUF header: {reason}")
