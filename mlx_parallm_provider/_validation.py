"""Shared field validation: each failure is an InvalidParameterError naming the field."""

from __future__ import annotations

import math

from .errors import InvalidParameterError


def check_int(name: str, value: object, minimum: int | None = None, maximum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidParameterError(name, f"must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise InvalidParameterError(name, f"must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise InvalidParameterError(name, f"must be <= {maximum}, got {value}")


def check_number(
    name: str, value: object, minimum: float | None = None, maximum: float | None = None
) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidParameterError(name, f"must be a number, got {value!r}")
    if not math.isfinite(value):
        raise InvalidParameterError(name, f"must be finite, got {value}")
    if minimum is not None and value < minimum:
        raise InvalidParameterError(name, f"must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise InvalidParameterError(name, f"must be <= {maximum}, got {value}")
