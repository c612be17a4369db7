"""Shared field validation: each failure is an InvalidParameterError naming the field (and
:func:`env_int`, for the environment knobs read outside :class:`.config.EngineConfig`)."""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Iterable, Mapping
from typing import Any, Optional

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


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def env_choice(name: str) -> Optional[bool]:
    """Environment variable ``name`` as a yes / no: True for 1 / true / yes / on, False for
    0 / false / no / off (any case), None when unset or anything else."""
    value = os.environ.get(name, "").strip().lower()
    return True if value in _TRUE else False if value in _FALSE else None


def env_flag(name: str) -> bool:
    """Whether environment variable ``name`` is set to 1 / true / yes / on (any case)."""
    return env_choice(name) is True


def check_text(name: str, text: str) -> None:
    """Raise :class:`InvalidParameterError` naming ``name`` if ``text`` is not valid Unicode
    text: a lone surrogate (``"\\ud800"``, which a JSON body can spell as an escape) cannot be
    encoded as UTF-8, so no tokenizer takes it. ASCII text is accepted without a copy."""
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        char = text[error.start]
        raise InvalidParameterError(
            name,
            f"holds a lone surrogate (U+{ord(char):04X}) at character {error.start}, which is not valid "
            "Unicode text (UTF-8 cannot encode it); send valid UTF-8 text",
        ) from None


def check_nested(name: str, value: Any, max_depth: int, limit: str = "") -> None:
    """Raise :class:`InvalidParameterError` if ``value`` nests dicts and lists (or tuples)
    more than ``max_depth`` levels deep, or holds a key or string that :func:`check_text`
    refuses (naming the path to it). Iterative, and stops at the first level over the limit,
    so a value nested past Python's recursion limit (or a cycle) is refused, not recursed
    into. ``limit`` names the knob in the message, e.g. ``"GrammarLimits.max_depth"``."""
    stack: list[tuple[Any, int, Any]] = [(value, 1, None)]
    deepest_seen: dict[int, int] = {}  # a container shared by several parents is walked again only deeper
    while stack:
        node, depth, path = stack.pop()
        if isinstance(node, str):
            if not node.isascii():
                check_text(_path_name(name, path), node)
            continue
        if isinstance(node, Mapping):
            items: Iterable[tuple[Any, Any]] = node.items()
        elif isinstance(node, (list, tuple)):
            items = enumerate(node)
        else:
            continue
        if depth > max_depth:
            raise _too_deep(name, max_depth, limit)
        if deepest_seen.get(id(node), 0) >= depth:
            continue
        deepest_seen[id(node)] = depth
        for key, child in items:
            if isinstance(key, str) and not key.isascii():
                check_text(_path_name(name, (path, key)) + " (a key)", key)
            stack.append((child, depth + 1, (path, key)))


def _path_name(name: str, path: Any) -> str:
    keys = []
    while path is not None:
        path, key = path
        keys.append(key.encode("utf-8", "backslashreplace").decode("utf-8") if isinstance(key, str) else key)
    return name + "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in reversed(keys))


_JSON_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"?|[\[\]{}]')


def check_json_text_depth(name: str, text: str, max_depth: int, limit: str = "") -> None:
    """:func:`check_nested`'s depth limit for JSON text, read before it is parsed (without
    building anything): brackets inside strings do not count."""
    if text.count("[") + text.count("{") <= max_depth:
        return
    depth = 0
    for match in _JSON_TOKEN.finditer(text):
        token = match.group()
        if token in ("[", "{"):
            depth += 1
            if depth > max_depth:
                raise _too_deep(name, max_depth, limit)
        elif token in ("]", "}"):
            depth -= 1


def _too_deep(name: str, max_depth: int, limit: str) -> InvalidParameterError:
    return InvalidParameterError(
        name, f"nests objects and arrays more than {max_depth} levels deep, over the limit of "
        f"{max_depth} levels{f' ({limit})' if limit else ''}; flatten it"
    )
