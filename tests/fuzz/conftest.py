"""Registers the fuzz suite's Hypothesis profiles (:mod:`fuzzing`) before pytest reads
``--hypothesis-profile``: registered only when a fuzz module imported them, ``long`` was
unknown there and ``ci`` was Hypothesis's own until then."""

import fuzzing  # noqa: F401
