"""Hybrid models (attention layers beside state-space or linear-attention ones) through the
engine, beyond the architecture matrix's checks: each request's recurrent state kept in its
slot through preemption, requests joining while others decode, several choices of one
prompt, prompt logprobs, prefixes reused from the states kept at checkpoints, the settings
such a model runs without, and its memory counted.

Qwen3.5's gated DeltaNet (the largest state: a matrix per head) and Granite 4.0-H's Mamba 2,
each a tiny random model (``conftest.HYBRID_CONFIGS``)."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from conftest import HYBRID_CONFIGS, write_tiny_model
from engine_helpers import mlx_lm_greedy
from mlx_parallm_provider.config import EngineConfig
from mlx_parallm_provider.engine import Engine, SamplingParams
from mlx_parallm_provider.errors import InvalidParameterError

GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)


def _prompts(n: int) -> list[list[int]]:
    return [[1] + [100 + (7 * i + j) % 300 for j in range(4 + 9 * i)] for i in range(n)]


@pytest.fixture(scope="module", params=["qwen3_5", "granitemoehybrid"])
def hybrid(request, smollm_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    from mlx_parallm_provider.models import registry

    folder = write_tiny_model(tmp_path_factory.mktemp(request.param), smollm_tokenizer_dir, config=HYBRID_CONFIGS[request.param])
    return registry.load(str(folder))


@pytest.fixture
def engines(hybrid: Any):
    made: list[Engine] = []

    def make(**config: Any) -> Engine:
        made.append(Engine("hybrid", EngineConfig(**config), loaded=hybrid))
        return made[-1]

    yield make
    for engine in made:
        engine.shutdown()


def _mlx_lm_logprobs(loaded: Any, prompt: list[int], n: int) -> list[float]:
    """The logprob of each token mlx-lm's own greedy generation picks, over the model's own caches."""
    from mlx_lm.generate import generate_step

    from mlx_parallm_provider.models import backends

    with backends.using(loaded.model, "mlx"):
        steps = generate_step(mx.array(prompt), loaded.model, max_tokens=n, sampler=lambda x: mx.argmax(x, axis=-1),
                              prompt_cache=loaded.model.make_cache())
        return [logprobs[token].item() for token, logprobs in steps]


def test_alone_equals_mlx_lm_and_every_state_slot_comes_back(hybrid: Any, engines: Any) -> None:
    """Tokens and their logprobs as mlx-lm's own generation (the logprobs show a state carried
    wrong even where a tiny model's greedy choice does not change)."""
    prompts = _prompts(3)
    engine = engines()
    answers = [engine.generate_sync(p, SamplingParams(max_tokens=16, ignore_eos=True, logprobs=True)) for p in prompts]
    assert [a.token_ids for a in answers] == mlx_lm_greedy(hybrid, prompts, GREEDY)
    for answer, prompt in zip(answers, prompts):
        expected = _mlx_lm_logprobs(hybrid, prompt, 16)
        assert max(abs(e.logprob - want) for e, want in zip(answer.logprobs, expected)) < 1e-3
    kv = engine._core.kv  # noqa: SLF001
    assert not kv._slots and len(kv._free_slots) == 1  # noqa: SLF001  one request at a time: one slot, back


def test_a_pool_too_small_preempts_and_recomputed_states_answer_the_same(hybrid: Any, engines: Any) -> None:
    """Rows preempted mid-decode give back their state slot with their blocks and start again
    from zeros: every answer as alone."""
    prompts = _prompts(6)
    alone = engines(max_num_seqs=1)
    expected = [alone.generate_sync(p, GREEDY).token_ids for p in prompts]
    bytes_per_block = alone.stats()["kv_cache"]["kv_bytes_per_token"] * 8
    small = engines(kv_cache_memory_gb=12 * bytes_per_block / 1024**3, kv_block_size=8)

    async def together():
        return await asyncio.gather(*(small.generate(p, GREEDY) for p in prompts))

    assert [c.token_ids for c in asyncio.run(together())] == expected
    kv = small.stats()["kv_cache"]
    assert kv["num_preemptions"] > 0 and kv["kv_blocks_free"] == kv["kv_blocks_total"]
    assert not small._core.kv._slots  # noqa: SLF001


def test_requests_joining_while_others_decode(hybrid: Any, engines: Any) -> None:
    """A request arriving mid-decode prefills alone, then decodes beside rows whose states are
    well along; a short one leaves early and its slot goes to the next arrival."""
    prompts = _prompts(4)
    engine = engines()
    expected = [engine.generate_sync(p, GREEDY).token_ids for p in prompts]
    short = SamplingParams(max_tokens=3, ignore_eos=True)

    async def staggered():
        first = asyncio.ensure_future(engine.generate(prompts[0], GREEDY))
        early = asyncio.ensure_future(engine.generate(prompts[3], short))
        await asyncio.sleep(0.05)
        second = asyncio.ensure_future(engine.generate(prompts[1], GREEDY))
        await early
        third = asyncio.ensure_future(engine.generate(prompts[2], GREEDY))
        return await asyncio.gather(first, second, third, early)

    first, second, third, early = asyncio.run(staggered())
    assert [first.token_ids, second.token_ids, third.token_ids] == expected[:3]
    assert early.token_ids == expected[3][:3]


def test_several_choices_of_one_prompt(engines: Any) -> None:
    engine = engines()
    prompt = _prompts(2)[1]
    alone = engine.generate_sync(prompt, GREEDY).token_ids
    choices = engine.generate_many_sync([prompt], GREEDY, n=3)
    assert [c.token_ids for c in choices] == [alone] * 3
    seeded = SamplingParams(max_tokens=12, temperature=1.0, seed=5, ignore_eos=True)
    assert [c.token_ids for c in engine.generate_many_sync([prompt], seeded, n=2)] == \
        [engine.generate_sync(prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=s, ignore_eos=True)).token_ids
         for s in (5, 6)]


def test_prompt_logprobs_through_chunked_prefill(hybrid: Any, engines: Any) -> None:
    """Each prompt token's logprob, the prompt prefilled in chunks of 8 (the state carried
    from chunk to chunk), against the model run whole."""
    prompt = _prompts(4)[3]
    engine = engines(prefill_chunk_size=8, max_num_batched_tokens=8, max_num_seqs=4)
    answer = engine.generate_sync(prompt, SamplingParams(max_tokens=2, prompt_logprobs=0))
    logits = hybrid.model(mx.array([prompt]))[0].astype(mx.float32)
    expected = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    assert answer.prompt_logprobs[0] is None and len(answer.prompt_logprobs) == len(prompt)
    for i, entry in enumerate(answer.prompt_logprobs[1:], start=1):
        assert abs(entry.logprob - expected[i - 1, prompt[i]].item()) < 1e-3, i


def _logprobs(engine: Engine, prompt: list[int]) -> tuple[list[int], list[float], int]:
    answer = engine.generate_sync(prompt, SamplingParams(max_tokens=8, ignore_eos=True, logprobs=True))
    return answer.token_ids, [e.logprob for e in answer.logprobs], answer.usage.cached_tokens


@pytest.mark.parametrize("chunked", [False, True])
def test_prefixes_are_reused_from_the_states_kept_at_checkpoints(hybrid: Any, engines: Any, chunked: bool) -> None:
    """A long shared prefix is reused up to the last checkpoint inside it (every 512 tokens),
    a conversation's next turn up to the last block boundary of the turn before; tokens and
    logprobs as with the prefix cache off. Prefilled whole or in chunks of 64."""
    from mlx_parallm_provider.engine.kv.states import CHECKPOINT_TOKENS

    rng = random.Random(7)
    shared = [1] + [rng.randrange(3, 1000) for _ in range(599)]
    first, second = shared + [rng.randrange(3, 1000) for _ in range(20)], shared + [rng.randrange(3, 1000) for _ in range(30)]
    sizes = {"prefill_chunk_size": 64, "max_num_batched_tokens": 64, "max_num_seqs": 4} if chunked else {}
    on, off = engines(**sizes), engines(enable_prefix_caching=False, **sizes)
    bs = on.config.kv_block_size
    answer, _, _ = _logprobs(on, first)
    following = first + answer + [rng.randrange(3, 1000) for _ in range(10)]
    tokens, logprobs, cached = _logprobs(on, second)
    assert cached == CHECKPOINT_TOKENS  # the shared 600 tokens: their last checkpoint
    plain_tokens, plain_logprobs, _ = _logprobs(off, second)
    assert tokens == plain_tokens and max(abs(a - b) for a, b in zip(logprobs, plain_logprobs)) < 1e-3
    tokens, logprobs, cached = _logprobs(on, following)
    assert cached == (len(first) - 1) // bs * bs  # the first prompt's last block boundary
    plain_tokens, plain_logprobs, _ = _logprobs(off, following)
    assert tokens == plain_tokens and max(abs(a - b) for a, b in zip(logprobs, plain_logprobs)) < 1e-3
    assert on.stats()["kv_cache"]["state_checkpoints"] >= 4


def test_requests_arriving_together_wait_for_the_first_to_keep_the_shared_state(engines: Any) -> None:
    """A burst sharing a 600-token prefix: the first prefills it, the others wait and start
    from the state it kept at its last block boundary (592: inside the shared tokens, the
    first prompt being 605 long); answers as with the prefix cache off."""
    rng = random.Random(8)
    shared = [1] + [rng.randrange(3, 1000) for _ in range(599)]
    prompts = [shared + [rng.randrange(3, 1000) for _ in range(5 + i)] for i in range(4)]
    on, off = engines(), engines(enable_prefix_caching=False)

    async def together(engine: Engine) -> list[Any]:
        return await asyncio.gather(*(engine.generate(p, GREEDY) for p in prompts))

    got, plain = asyncio.run(together(on)), asyncio.run(together(off))
    assert [c.token_ids for c in got] == [c.token_ids for c in plain]
    last = (len(prompts[0]) - 1) // on.config.kv_block_size * on.config.kv_block_size
    assert last == 592 and sorted(c.usage.cached_tokens for c in got) == [0, last, last, last]


def test_the_settings_it_runs_without(engines: Any) -> None:
    engine = engines()
    config = engine.config
    assert config.enable_prefix_caching and not (config.async_scheduling or config.grammar_fast_forward)
    engine.generate_sync(_prompts(1)[0], SamplingParams(max_tokens=2))
    stats = engine.stats()
    assert stats["kv_cache"]["recurrent_state_bytes"] > 0
    kv = stats["kv_cache"]
    assert engine.memory_bytes()["kv"] == kv["kv_cache_bytes"] + kv["recurrent_state_bytes"] + kv["state_checkpoint_bytes"]
    assert engine._core.runner.decode_path().startswith("uncompiled (recurrent layers")  # noqa: SLF001
    with pytest.raises(InvalidParameterError, match="speculative: .*recurrent state"):
        engines(speculative="ngram")


def test_a_disk_tier_is_refused(engines: Any, tmp_path: Path) -> None:
    with pytest.raises(InvalidParameterError, match="kv_disk_path: .*not the recurrent states"):
        engines(kv_disk_path=str(tmp_path))
