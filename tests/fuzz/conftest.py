"""Registers the fuzz suite's Hypothesis profiles (:mod:`fuzzing`) before pytest reads
``--hypothesis-profile``: registered only when a fuzz module imported them, ``long`` was
unknown there and ``ci`` was Hypothesis's own until then; and the engine fixtures the
engine-level modules share."""

import fuzzing  # noqa: F401
import pytest

from mlx_parallm_provider.config import EngineConfig
from mlx_parallm_provider.engine import Engine


@pytest.fixture(scope="module")
def engine(tiny_model):
    """The engine-level fuzz modules' engine on the tiny model (a queue deep enough for
    every example's requests)."""
    engine = Engine("tiny", EngineConfig(max_queue=64), loaded=tiny_model)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def expected(engine):
    """What the innocent requests (:data:`fuzzing.INNOCENT_PROMPTS`) answer alone."""
    return [engine.generate_sync(p, fuzzing.INNOCENT).token_ids for p in fuzzing.INNOCENT_PROMPTS]
