"""Shared field validation: each failure is an InvalidParameterError naming the field
(:class:`Limit`: a setting's allowed values, which the configuration reference prints too)."""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Limit:
    """What a setting may hold: read by its validation (:meth:`check`) and by the
    configuration reference (:meth:`describe`), so a range is written once.

    ``kind`` is ``"int"``, ``"number"``, ``"bool"``, ``"choice"`` (one of ``choices``) or
    ``"text"`` (a non-empty string); ``optional`` also allows None; ``positive`` refuses 0
    (``hint`` says what to use instead); text must match ``pattern`` where set."""

    kind: str
    minimum: Optional[float] = None
    maximum: Optional[float] = None
    choices: tuple[Any, ...] = ()
    optional: bool = False
    positive: bool = False
    hint: str = ""
    pattern: str = ""
    words: str = ""  # the allowed values in words, where the kind's own are not enough

    def check(self, name: str, value: object) -> None:
        """Raise :class:`InvalidParameterError` naming ``name`` unless ``value`` fits."""
        if value is None and self.optional:
            return
        if self.kind == "int":
            check_int(name, value, self.minimum, self.maximum)  # type: ignore[arg-type]
        elif self.kind == "number":
            check_number(name, value, self.minimum, self.maximum)
        elif self.kind == "bool":
            if not isinstance(value, bool):
                raise InvalidParameterError(name, f"must be a bool{' or None' if self.optional else ''}, got {value!r}")
        elif self.kind == "choice":
            if isinstance(value, bool) or value not in self.choices:
                options = ", ".join(map(repr, self.choices)) + (" or None" if self.optional else "")
                raise InvalidParameterError(name, f"must be one of {options}, got {value!r}")
        elif self.kind == "text":
            if not isinstance(value, str) or not value.strip():
                raise InvalidParameterError(name, f"must be a non-empty string, got {value!r}")
            if self.pattern and not re.fullmatch(self.pattern, value):
                raise InvalidParameterError(name, f"must match {self.pattern}, got {value!r}")
        if self.positive and value == 0:
            raise InvalidParameterError(name, f"must be > 0{f' ({self.hint})' if self.hint else ''}")

    def describe(self) -> str:
        """The allowed values in words, for the configuration reference."""
        if self.words:
            return self.words
        if self.kind in ("int", "number"):
            low = "> 0" if self.positive and self.minimum == 0 else None
            if low is None and self.minimum is not None:
                low = f">= {self.minimum:g}"
            if self.minimum is not None and self.maximum is not None and low.startswith(">="):
                text = f"{self.minimum:g} .. {self.maximum:g}"
            else:
                text = ", ".join(p for p in (low, None if self.maximum is None else f"<= {self.maximum:g}") if p) or "any"
        elif self.kind == "bool":
            text = "true / false"
        elif self.kind == "choice":
            text = " / ".join("None" if c is None else repr(c) for c in self.choices)
        else:
            text = f"text matching ``{self.pattern}``" if self.pattern else "non-empty text"
        return f"{text} / None" if self.optional else text


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
