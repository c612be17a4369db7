"""A progress bar on stderr while requests complete (tqdm when installed, else nothing)."""

from __future__ import annotations

import sys
from typing import Any, Callable


class Progress:
    """``with Progress(total, label, enabled) as tick: ... tick()`` once per finished request."""

    def __init__(self, total: int, label: str, enabled: bool = True) -> None:
        self._bar: Any = None
        if enabled and sys.stderr.isatty():
            try:
                from tqdm import tqdm
            except ImportError:
                return
            self._bar = tqdm(total=total, desc=label, unit="req", leave=False, file=sys.stderr)

    def __enter__(self) -> Callable[[], None]:
        return self.tick

    def tick(self) -> None:
        if self._bar is not None:
            self._bar.update(1)

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.close()
