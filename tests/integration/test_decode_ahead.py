"""Async scheduling (engine/decode_ahead.py): step t+1 is built on step t's lazy tokens and
queued while step t computes; the tokens must be those of plain steps, whatever ends, joins
or leaves meanwhile."""

from __future__ import annotations

import asyncio

from engine_helpers import EchoingModel
from mlx_parallm_provider.engine import SamplingParams


def _prompts(n: int) -> list[list[int]]:
    return [[100 + (7 * i + j) % 300 for j in range(5 + 9 * i)] for i in range(n)]


def _both(make_engine, model=None, **config):
    """An engine decoding ahead and one that does not, otherwise alike."""
    on = make_engine(model, async_scheduling=True, **config)
    off = make_engine(model, async_scheduling=False, **config)
    return on, off


def _steps_ahead(engine) -> int:
    """Steps whose tokens were computed ahead (the worker starts with the first request)."""
    return engine._core.runner.ahead.steps


def _together(engine, prompts, params):
    async def main():
        return await asyncio.gather(*(engine.generate(p, q) for p, q in zip(prompts, params)))
    return [(c.token_ids, c.text, c.finish_reason) for c in asyncio.run(main())]


def _with_a_late_row(engine, prompts, params, late_prompt, late_params) -> list[list[int]]:
    """The rows streamed together, and one more request arriving once a row has 10 tokens
    (while they decode ahead); every row's tokens, the late one's last."""
    async def main():
        arrived = asyncio.Event()

        async def row(p, q):
            got = []
            async for d in engine.stream(p, q):
                got += d.token_ids
                if len(got) >= 10:
                    arrived.set()
            return got

        async def late_row():
            await arrived.wait()
            return (await engine.generate(late_prompt, late_params)).token_ids

        return await asyncio.gather(*(row(p, q) for p, q in zip(prompts, params)), late_row())

    return asyncio.run(main())


def test_batched_greedy_rows_get_the_tokens_of_plain_steps(make_engine) -> None:
    prompts = _prompts(6)
    params = [SamplingParams(max_tokens=3 + 5 * i, ignore_eos=True) for i in range(6)]  # rows leave one by one
    on, off = _both(make_engine)
    assert _together(on, prompts, params) == _together(off, prompts, params)
    assert off._core.runner.ahead is None and _steps_ahead(on) > 20  # (steps whose tokens were computed ahead)
    alone = [on.generate_sync(p, q).token_ids for p, q in zip(prompts, params)]
    assert alone == [t for t, _, _ in _together(off, prompts, params)]
    kv = on.stats()["kv_cache"]
    assert kv["kv_blocks_free"] == kv["kv_blocks_total"]


def test_rows_ending_by_a_stop_token_or_string_while_the_next_step_runs_ahead(make_engine) -> None:
    """The step computed ahead of a row that ended (a stop token, as EOS; a stop string) is
    wasted: its KV write must reach no one, so the same prompts again (from their cached
    blocks) answer alike."""
    prompts = _prompts(3)
    on, off = _both(make_engine)
    free = _together(off, prompts, [SamplingParams(max_tokens=30, ignore_eos=True)] * 3)
    text = free[1][1]
    params = [SamplingParams(max_tokens=30, ignore_eos=True, stop_token_ids=[free[0][0][9]]),
              SamplingParams(max_tokens=30, ignore_eos=True, stop=[text[len(text) // 2 : len(text) // 2 + 3]]),
              SamplingParams(max_tokens=30, ignore_eos=True)]
    first = _together(on, prompts, params)
    assert first == _together(off, prompts, params)
    assert [reason for _, _, reason in first] == ["stop", "stop", "length"]
    assert len(first[0][0]) <= 9 and len(first[1][0]) < 30
    assert _together(on, prompts, params) == first  # from the cached blocks
    assert _steps_ahead(on) > 0


def test_rows_that_need_the_host_between_steps_decode_plainly(make_engine) -> None:
    prompts = _prompts(3)
    logprobs = [SamplingParams(max_tokens=12, ignore_eos=True, logprobs=True)] * 3
    on, off = _both(make_engine)
    assert _together(on, prompts, logprobs) == _together(off, prompts, logprobs)
    assert _steps_ahead(on) == 0
    mixed = [SamplingParams(max_tokens=12, ignore_eos=True), SamplingParams(max_tokens=12, temperature=0.8, seed=7),
             SamplingParams(max_tokens=12, ignore_eos=True, logprobs=True)]
    assert _together(on, prompts, mixed) == _together(off, prompts, mixed)
    assert _steps_ahead(on) == 0


def test_rows_with_penalties_and_a_logit_bias_decode_ahead_as_plain_steps_sample_them(make_engine, tiny_model) -> None:
    """The step ahead counts the step's own token, not yet on the host, in each row's
    penalties (a model that repeats a row's last token unless a penalty counts it): greedy
    and seeded rows with each penalty (a history shorter than the penalties' window too), a
    logit bias, and a row without, get the tokens of plain steps, alone or batched, and a row
    arriving meanwhile changes nothing."""
    prompts = [[5, 6, 7], *_prompts(5)[1:]]
    params = [SamplingParams(max_tokens=40, ignore_eos=True, repetition_penalty=1.5),
              SamplingParams(max_tokens=40, ignore_eos=True, frequency_penalty=1.2, presence_penalty=0.4),
              SamplingParams(max_tokens=40, temperature=0.9, seed=3, ignore_eos=True, presence_penalty=1.5, top_k=20),
              SamplingParams(max_tokens=40, ignore_eos=True, logit_bias={110: 3.0, 111: -100.0}),
              SamplingParams(max_tokens=40, ignore_eos=True)]
    on, off = _both(make_engine, EchoingModel(tiny_model.model, margin=0.5))
    expected = _together(off, prompts, params)
    assert _together(on, prompts, params) == expected and _steps_ahead(on) > 20
    plain, penalised = expected[-1][0], [t for t, _, _ in expected[:3]]
    assert len(set(plain[1:])) == 1 and all(len(set(t)) > 20 for t in penalised)  # (the penalties moved the rows on)
    assert [on.generate_sync(p, q).token_ids for p, q in zip(prompts, params)] == [t for t, _, _ in expected]
    late = (prompts[0], SamplingParams(max_tokens=8, ignore_eos=True, presence_penalty=2.0))
    got = _with_a_late_row(on, prompts, params, *late)
    assert got[: len(params)] == [t for t, _, _ in expected] and got == _with_a_late_row(off, prompts, params, *late)


def test_seeded_rows_draw_the_same_tokens_ahead_and_when_a_step_ahead_is_dropped(make_engine) -> None:
    """Sampled rows are computed ahead too, each drawing with its own key; when a row that
    cannot be (logprobs) joins, the step computed ahead is dropped and the keys put back, so
    seeded rows draw what they draw without async scheduling, alone or batched."""
    prompts = _prompts(4)
    seeded = [SamplingParams(max_tokens=64, temperature=0.9, top_p=0.95, seed=11 + i, ignore_eos=True) for i in range(3)]
    on, off = _both(make_engine)
    expected = _together(off, prompts[:3], seeded)
    assert _together(on, prompts[:3], seeded) == expected and _steps_ahead(on) > 10
    assert [on.generate_sync(p, q).token_ids for p, q in zip(prompts, seeded)] == [t for t, _, _ in expected]
    late = (prompts[3], SamplingParams(max_tokens=6, ignore_eos=True, logprobs=True))
    got = _with_a_late_row(on, prompts, seeded, *late)
    assert got[:3] == [t for t, _, _ in expected] and got == _with_a_late_row(off, prompts, seeded, *late)


def test_requests_joining_and_leaving_mid_stream(make_engine) -> None:
    """A request that arrives while others decode ahead, and a stream cancelled meanwhile,
    leave the others' tokens as plain steps give them."""
    long, late, dropped = _prompts(3)
    params = SamplingParams(max_tokens=40, ignore_eos=True)

    async def main(engine):
        async def first():
            got = []
            async for delta in engine.stream(long, params):
                got += delta.token_ids
                if len(got) == 10:
                    tasks.append(asyncio.ensure_future(engine.generate(late, params)))
            return got

        async def cancelled():
            n = 0
            async for delta in engine.stream(dropped, params):
                n += len(delta.token_ids)
                if n >= 7:
                    break  # leaves the batch while the next step may be computed ahead
            return n

        tasks: list = []
        got, n = await asyncio.gather(first(), cancelled())
        return got, (await tasks[0]).token_ids, n

    on, off = _both(make_engine)
    assert asyncio.run(main(on))[:2] == asyncio.run(main(off))[:2]
    assert _steps_ahead(on) > 10



def test_a_full_batch_with_requests_queued_behind_it_still_runs_ahead(make_engine) -> None:
    """With every slot taken, a waiting prompt cannot be admitted next step anyway (unless a
    row ends: then it joins, and the rows computed ahead keep their tokens)."""
    prompts = _prompts(4)
    params = [SamplingParams(max_tokens=12, ignore_eos=True)] * 4
    on, off = _both(make_engine, max_num_seqs=1)
    assert _together(on, prompts, params) == _together(off, prompts, params)
    assert _steps_ahead(on) > 30  # (~10 a request, not only the last one's)
