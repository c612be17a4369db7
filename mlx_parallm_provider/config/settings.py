"""A setting: one field's allowed values and the environment variable that gives its default,
and how a variable's text is read."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields
from typing import Any, Callable, ClassVar, Optional

from .._validation import Limit
from ..errors import InvalidParameterError
from .environment import FALSE_WORDS, TRUE_WORDS, env_text

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Setting:
    """One field's allowed values, and where it has one, the environment variable that gives
    its default (``parse`` reads the variable's text; ValueError: warned about, ``default``)."""

    limit: Limit
    env: Optional[str] = None
    default: Any = None
    parse: Optional[Callable[[str], Any]] = None

    def from_env(self, name: str) -> Any:
        """The value the environment gives field ``name``: :attr:`default` where unset or bad
        (warned), an integer out of range clamped into it (warned)."""
        raw = env_text(self.env) if self.env else ""
        if not raw:
            return self.default
        try:
            value = (self.parse or parse_int)(raw)
        except ValueError as error:
            logger.warning("%s=%r is not %s: using %r", self.env, raw, error or "valid", self.default)
            return self.default
        if self.limit.kind == "int" and isinstance(value, int):
            low = self.limit.minimum if self.limit.minimum is not None else value
            high = self.limit.maximum if self.limit.maximum is not None else value
            bounded = int(min(max(value, low), high))
            if bounded != value:
                logger.warning("%s=%d is outside %s: using %d", self.env, value, self.limit.describe(), bounded)
            value = bounded
        try:
            self.limit.check(name, value)
        except InvalidParameterError as error:
            logger.warning("%s=%r: %s: using %r", self.env, raw, error, self.default)
            return self.default
        return value


def parse_int(raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise ValueError("an integer") from None


def parse_choice(raw: str) -> bool:
    value = raw.lower()
    if value in TRUE_WORDS or value in FALSE_WORDS:
        return value in TRUE_WORDS
    raise ValueError("1 / true / yes / on or 0 / false / no / off")


def parse_blas(raw: str) -> str:
    return "off" if raw.lower() in ("off", "0", "none", "false") else "auto" if raw.lower() == "auto" else raw


def parse_word(raw: str) -> str:
    return raw.strip().lower()


def parse_int8(raw: str) -> int:
    if raw in ("8", "16"):
        return int(raw)
    try:
        return 8 if parse_choice(raw) else 0
    except ValueError:
        raise ValueError("0, 1, 8 or 16") from None


def parse_march(raw: str) -> Optional[str]:
    return None if raw == "native" else raw


def parse_number(raw: str) -> float:
    try:
        return float(raw)
    except ValueError:
        raise ValueError("a number") from None


def setting_field(table: dict[str, Setting], name: str) -> Any:
    """A dataclass field whose default ``table[name]`` reads from the environment each time an
    instance is made."""
    return field(default_factory=lambda: table[name].from_env(name))


class CheckedSettings:
    """A frozen dataclass of the settings in ``_SETTINGS``, each checked against its limit when
    made (:class:`DeviceConfig`, :class:`PoolConfig`)."""

    _SETTINGS: ClassVar[dict[str, Setting]]

    def __post_init__(self) -> None:
        for name, setting in self._SETTINGS.items():
            setting.limit.check(name, getattr(self, name))

    def as_dict(self) -> dict[str, Any]:
        """Plain dict of every setting."""
        return {f.name: getattr(self, f.name) for f in fields(self)}  # type: ignore[arg-type]
