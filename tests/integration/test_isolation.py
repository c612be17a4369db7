"""Issue 8: one bad request never hurts another. Each test names the defect it pins.

Parameters that pass validation used to crash the process, kill the worker (failing every
neighbour) or hang; these tests drive those requests next to innocent ones and check that
the bad one gets a typed package error and every neighbour its normal answer.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from engine_helpers import ScriptedModel, TokenCostModel
from mlx_parallm_provider.engine import SamplingParams
from mlx_parallm_provider.engine import core as worker_module
from mlx_parallm_provider.engine import sampling as sampling_module
from mlx_parallm_provider.engine.request import ResultSink
from mlx_parallm_provider.errors import EngineDeadError, InvalidParameterError, MLXParallmError, RequestFailedError, RequestTimeoutError

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
PROMPTS = ["the quick brown fox", "seven curious cats", "a lazy dog", "over the old wall"]


def run(coro, timeout: float = 60):
    """Run a coroutine; a hang becomes a test failure instead of a stuck suite."""
    async def bounded():
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(bounded())


async def _all(engine, prompts, params=GREEDY):
    return await asyncio.gather(*(engine.generate(p, params) for p in prompts), return_exceptions=True)


def _expected(engine) -> list[list[int]]:
    return [engine.generate_sync(p, GREEDY).token_ids for p in PROMPTS]


async def _with_neighbours(engine, bad_prompt, bad_params):
    """The bad request and four innocent greedy ones, submitted together."""
    return await asyncio.gather(
        engine.generate(bad_prompt, bad_params),
        *(engine.generate(p, GREEDY) for p in PROMPTS),
        return_exceptions=True,
    )


def _assert_neighbours_fine(results, expected) -> None:
    assert [r.token_ids for r in results] == expected, results


# -- #1 logit_bias past the vocabulary crashed the process (SIGSEGV / double free) ----------

CRASH_SCRIPT = textwrap.dedent(
    """
    import asyncio, json, sys
    import mlx_parallm_provider
    from mlx_parallm_provider.engine import Engine, SamplingParams
    from mlx_parallm_provider.models import registry

    engine = Engine("tiny", loaded=registry.load(sys.argv[1]))
    if sys.argv[2] == "skip-submit-check":
        engine.vocab_size = None  # as if the model did not say: the worker must still refuse
    greedy = SamplingParams(max_tokens=8, ignore_eos=True)
    expected = engine.generate_sync("hello world", greedy).token_ids

    async def main():
        out = []
        for key in (49152, 60000, 10**7, "99999999"):
            bad = SamplingParams(max_tokens=8, logit_bias={key: 5})
            got = await asyncio.gather(engine.generate("hi", bad), engine.generate("hello world", greedy),
                                       return_exceptions=True)
            out.append([type(got[0]).__name__, str(got[0]), getattr(got[1], "token_ids", None) == expected])
        return out

    print(json.dumps(asyncio.run(main())))
    engine.shutdown()
    """
)


@pytest.mark.parametrize("mode", ["submit-check", "skip-submit-check"])
def test_logit_bias_outside_vocabulary_is_refused_not_a_crash(tiny_model_dir, mode) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", CRASH_SCRIPT, str(tiny_model_dir), mode],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, f"the process died (rc {proc.returncode}): {proc.stderr[-2000:]}"
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    expected_error = "InvalidParameterError" if mode == "submit-check" else "RequestFailedError"
    for error, message, neighbour_ok in results:
        assert error == expected_error and "logit_bias" in message
        assert neighbour_ok


# -- #2 seed >= 2**64 killed the worker and hung its own request -----------------------------

def test_seed_beyond_64_bits_is_invalid() -> None:
    with pytest.raises(InvalidParameterError, match="seed"):
        SamplingParams(seed=2**64)
    SamplingParams(seed=2**64 - 1)


def test_a_request_failing_its_set_up_fails_alone_and_is_answered(make_engine) -> None:
    engine = make_engine()
    expected = _expected(engine)
    bad = SamplingParams(max_tokens=8, temperature=1.0)
    bad.seed = 2**64  # past validation, as the defect's request was: mx.random.key raises
    first, *rest = run(_with_neighbours(engine, "hi", bad))
    assert isinstance(first, RequestFailedError) and "set up" in str(first)
    _assert_neighbours_fine(rest, expected)
    assert engine._core.alive
    assert engine.stats()["running"] == 0 and engine.stats()["waiting"] == 0


# -- #3 top_k above the vocabulary killed the worker -----------------------------------------

def test_top_k_is_checked_against_the_vocabulary(make_engine) -> None:
    engine = make_engine()
    with pytest.raises(InvalidParameterError, match="top_k.*49152"):
        engine.generate_sync("hi", SamplingParams(max_tokens=4, temperature=1.0, top_k=49153))
    # top_k equal to the vocabulary keeps every token: allowed, and it filters nothing.
    full = engine.generate_sync("hi", SamplingParams(max_tokens=4, temperature=1.0, top_k=49152, seed=3))
    plain = engine.generate_sync("hi", SamplingParams(max_tokens=4, temperature=1.0, seed=3))
    assert full.token_ids == plain.token_ids


def test_a_row_whose_sampling_fails_fails_alone(make_engine, monkeypatch) -> None:
    real_filters = sampling_module.RowSampler.filters

    def filters_(self):  # asked of every drawing row, whichever ops filter and draw
        if self.params.min_p == 0.125:  # the marked request
            raise ValueError("sampler bug")
        return real_filters.fget(self)

    monkeypatch.setattr(sampling_module.RowSampler, "filters", property(filters_))
    engine = make_engine()
    expected = _expected(engine)
    seeded = SamplingParams(max_tokens=8, temperature=1.0, seed=7, ignore_eos=True)
    seeded_alone = engine.generate_sync("seeded", seeded).token_ids

    async def main():
        return await asyncio.gather(
            engine.generate("hi", SamplingParams(max_tokens=8, temperature=1.0, min_p=0.125)),
            engine.generate("seeded", seeded),
            *(engine.generate(p, GREEDY) for p in PROMPTS),
            return_exceptions=True,
        )

    bad, seeded_crowd, *rest = run(main())
    assert isinstance(bad, RequestFailedError) and isinstance(bad.__cause__, ValueError)
    assert "sampl" in str(bad)
    assert seeded_crowd.token_ids == seeded_alone  # its key was not advanced by the failed try
    _assert_neighbours_fine(rest, expected)


# -- #4 stop=5 / stop_token_ids=5 raised a raw TypeError ------------------------------------

@pytest.mark.parametrize("field", ["stop", "stop_token_ids", "logit_bias"])
def test_wrongly_typed_containers_are_invalid_parameters(field) -> None:
    with pytest.raises(InvalidParameterError, match=field):
        SamplingParams(**{field: 5})


def test_stop_token_ids_are_checked_against_the_vocabulary(make_engine) -> None:
    engine = make_engine()
    with pytest.raises(InvalidParameterError, match=r"stop_token_ids\[1\].*0\.\.49151"):
        engine.generate_sync("hi", SamplingParams(max_tokens=4, stop_token_ids=[2, 49152]))


# -- #6 deadlines waited for the end of a long prefill step ---------------------------------

def test_deadline_is_honoured_during_a_long_prefill(make_engine, tiny_model) -> None:
    slow = TokenCostModel(tiny_model.model, seconds_per_token=0.01)
    # 4 prompts of ~62 tokens, each under prefill_chunk_size, so they are prefilled as one
    # batch: ~2.5 s if done in one pass, 0.64 s per piece of 64 tokens. (Prefix caching
    # would prefill one of these near-identical prompts alone and reuse it for the others.)
    engine = make_engine(slow, prefill_chunk_size=64, max_num_batched_tokens=1024, enable_prefix_caching=False)
    long_prompts = [" ".join(["word"] * 60) + f" {i}" for i in range(4)]
    params = SamplingParams(max_tokens=4, timeout=0.2)

    async def main():
        tic = time.perf_counter()
        results = await _all(engine, long_prompts, params)
        return results, time.perf_counter() - tic

    results, elapsed = run(main())
    assert all(isinstance(r, RequestTimeoutError) for r in results)
    assert elapsed < 1.5, f"timeouts took {elapsed:.2f}s to arrive"
    time.sleep(0.5)  # let the worker finish the piece it was computing
    assert slow.tokens <= 2 * 64, f"the worker computed {slow.tokens} tokens for expired requests"
    assert engine.stats()["running"] == 0


def test_sync_callers_get_their_timeout_on_time(make_engine, tiny_model) -> None:
    engine = make_engine(TokenCostModel(tiny_model.model, seconds_per_token=0.01), prefill_chunk_size=256)
    tic = time.perf_counter()
    with pytest.raises(RequestTimeoutError):
        engine.generate_sync(" ".join(["word"] * 200), SamplingParams(max_tokens=4, timeout=0.2))
    assert time.perf_counter() - tic < 1.5


# -- #7 a fault while processing one request's output reached its caller untyped -------------
# (tests/integration/test_engine.py::test_fault_in_one_request_fails_only_it)

def test_a_broken_result_sink_cancels_only_its_request(make_engine) -> None:
    engine = make_engine()
    expected = _expected(engine)

    class BrokenSink(ResultSink):
        def put(self, item):
            raise RuntimeError("caller's queue is gone")

    bad = engine._submit("hi", SamplingParams(max_tokens=50, ignore_eos=True), None, BrokenSink(), stream=True)
    results = run(_all(engine, PROMPTS))
    _assert_neighbours_fine(results, expected)
    deadline = time.monotonic() + 5
    while not bad.finished and time.monotonic() < deadline:
        time.sleep(0.01)
    assert bad.finished and len(bad.output_ids) < 50


# -- #8 failed requests stayed in the metrics forever ----------------------------------------

def test_worker_death_and_shutdown_finish_every_request_in_the_metrics(make_engine, tiny_model) -> None:
    scripted = ScriptedModel(tiny_model.model, [100, 101, 102], vocab_size=49152)
    engine = make_engine(scripted)
    scripted.fail_with = RuntimeError("model step exploded")
    errors = run(_all(engine, PROMPTS))
    assert all(isinstance(e, EngineDeadError) and "retry" in str(e) for e in errors)
    assert engine.stats()["finished"] == 4 and engine.metrics.num_tracked == 0

    scripted.fail_with = None
    scripted.gate = threading.Event()

    async def shut_down_mid_flight():
        calls = [asyncio.ensure_future(engine.generate(p, GREEDY)) for p in PROMPTS]
        await asyncio.sleep(0.2)  # the worker is now inside a model call, held by the gate
        await asyncio.to_thread(_shutdown_releasing, engine, scripted.gate)
        return await asyncio.gather(*calls, return_exceptions=True)

    errors = run(shut_down_mid_flight())
    assert all(isinstance(e, EngineDeadError) and "shut down" in str(e) for e in errors)
    assert engine.stats()["finished"] == 8 and engine.metrics.num_tracked == 0


def _shutdown_releasing(engine, gate) -> None:
    threading.Timer(0.2, gate.set).start()  # the step in flight ends, then the worker stops
    engine.shutdown()


# -- isolation as a property: every per-request fault site fails one request, typed ---------

@pytest.mark.parametrize("site", ["set_up", "sample", "detokenize"])
def test_each_fault_site_fails_one_request_alone(make_engine, monkeypatch, site) -> None:
    marker = "FAULT"

    if site == "set_up":
        real_init = sampling_module.RowSampler.__init__

        def init(self, params, grammar=None, **kwargs):
            if marker in params.stop:
                raise KeyError("set-up fault")
            real_init(self, params, grammar, **kwargs)

        monkeypatch.setattr(sampling_module.RowSampler, "__init__", init)
    elif site == "sample":
        real_check = sampling_module.RowSampler.check_width

        def check_width(self, vocab):
            if self.params.logit_bias == {7: 1.0}:
                raise KeyError("sampling fault")
            real_check(self, vocab)

        monkeypatch.setattr(sampling_module.RowSampler, "check_width", check_width)
    else:
        class Exploding(worker_module.TextStream):
            def add_token(self, token_id):
                if marker in self.matcher.stops:
                    raise KeyError("detokenizer fault")
                return super().add_token(token_id)

        monkeypatch.setattr(worker_module, "TextStream", Exploding)

    engine = make_engine()
    expected = _expected(engine)
    bad = SamplingParams(max_tokens=8, stop=[marker], logit_bias={7: 1.0})
    first, *rest = run(_with_neighbours(engine, "hi", bad))
    assert isinstance(first, RequestFailedError) and isinstance(first, MLXParallmError)
    assert isinstance(first.__cause__, KeyError)
    _assert_neighbours_fine(rest, expected)
    assert engine._core.alive and engine.stats()["running"] == 0
