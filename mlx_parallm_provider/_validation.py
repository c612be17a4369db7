"""Shared field validation: each failure is an InvalidParameterError naming the field (and
:func:`env_int`, for the environment knobs read outside :class:`.config.EngineConfig`)."""

from __future__ import annotations

import logging
import math
import os

from .errors import InvalidParameterError

logger = logging.getLogger(__name__)


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


def env_int(name: str, default: int, minimum: int, maximum: int) -> int:
    """The integer in environment variable ``name``, bounded: ``default`` where it is unset or
    not an integer, clamped into ``minimum..maximum`` where out of range (each with a warning
    naming the variable). Never raises: a bad knob must not fail every request."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        logger.warning("%s=%r is not an integer: using %d", name, raw, default)
        return default
    bounded = min(max(value, minimum), maximum)
    if bounded != value:
        logger.warning("%s=%d is outside %d..%d: using %d", name, value, minimum, maximum, bounded)
    return bounded
