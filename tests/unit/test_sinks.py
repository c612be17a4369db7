"""A step's results reach their callers: those of one event loop in one call on it, each
request's in order; a closed loop's requests are cancelled, not lost in the worker."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

from mlx_parallm_provider.engine.fanout import TaggedSink
from mlx_parallm_provider.engine.sinks import LoopSink, ThreadSink, deliver_all


def _request(sink, name: str) -> SimpleNamespace:
    request = SimpleNamespace(sink=sink, request_id=name, cancelled=False)
    if isinstance(sink, LoopSink):
        sink.request = request
    return request


def _from_a_worker(results, deliver) -> None:
    worker = threading.Thread(target=deliver_all, args=(results, deliver))
    worker.start()
    worker.join()


def test_a_steps_results_for_one_loop_go_in_one_call_each_request_in_order() -> None:
    async def main() -> tuple[list, list, int]:
        loop = asyncio.get_running_loop()
        calls = 0
        real = loop.call_soon_threadsafe

        def counting(*args):
            nonlocal calls
            calls += 1
            return real(*args)

        loop.call_soon_threadsafe = counting  # (this test's own loop)
        sinks = [LoopSink() for _ in range(3)]
        shared: asyncio.Queue = asyncio.Queue()
        tagged = [TaggedSink(lambda item: None, i, loop.is_closed, loop, shared.put_nowait) for i in range(2)]
        requests = [_request(s, f"r{i}") for i, s in enumerate([*sinks, *tagged])]
        results = [(r, f"{r.request_id}-{t}") for t in range(4) for r in requests]
        _from_a_worker(results, lambda r, item: (_ for _ in ()).throw(AssertionError("not by deliver")))
        await asyncio.sleep(0.05)
        got = [[s.queue.get_nowait() for _ in range(s.queue.qsize())] for s in sinks]
        return got, [shared.get_nowait() for _ in range(shared.qsize())], calls

    got, shared, calls = asyncio.run(main())
    assert calls == 1
    assert got == [[f"r{i}-{t}" for t in range(4)] for i in range(3)]
    assert shared == [(i, f"r{3 + i}-{t}") for t in range(4) for i in range(2)]


def test_sinks_without_a_loop_and_the_sinks_of_a_closed_loop_get_their_results_by_deliver() -> None:
    loop = asyncio.new_event_loop()
    closed = LoopSink.__new__(LoopSink)
    closed.loop, closed.queue, closed.request = loop, asyncio.Queue(), None
    loop.close()
    threaded = ThreadSink()
    requests = [_request(threaded, "thread"), _request(closed, "closed")]
    closed.request = requests[1]
    delivered = []

    def deliver(request, item) -> None:
        delivered.append((request.request_id, item))
        request.sink.put(item)

    _from_a_worker([(requests[0], 1), (requests[1], 2), (requests[0], 3)], deliver)
    assert delivered == [("thread", 1), ("thread", 3), ("closed", 2)]
    assert [threaded.queue.get_nowait() for _ in range(2)] == [1, 3]
    assert requests[1].cancelled and not requests[0].cancelled  # nobody listens on a closed loop


def test_a_sink_failing_on_the_loop_harms_no_other() -> None:
    async def main() -> list:
        loop = asyncio.get_running_loop()
        good = LoopSink()
        broken = TaggedSink(lambda item: None, 0, loop.is_closed, loop, lambda item: 1 / 0)
        _from_a_worker([(_request(broken, "broken"), "x"), (_request(good, "good"), "y")], lambda r, i: None)
        await asyncio.sleep(0.05)
        return [good.queue.get_nowait() for _ in range(good.queue.qsize())]

    assert asyncio.run(main()) == ["y"]
