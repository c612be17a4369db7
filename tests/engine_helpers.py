"""Helpers for engine tests: a scripted wrapper around a real model, and engine factories."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any, Awaitable, Callable, Optional, Sequence, TypeVar

import mlx.core as mx


class ScriptedModel:
    """Wraps a real mlx-lm model: runs it (so the KV cache code is exercised for real) but
    replaces its logits so that the token after absolute position ``p`` is
    ``script[(p + 1) % len(script)]``. Optional hooks make a forward block or raise."""

    def __init__(self, inner: Any, script: Sequence[int], vocab_size: int) -> None:
        self.inner = inner
        self.layers = inner.layers
        self.script = mx.array(list(script))
        self.vocab_size = vocab_size
        self.gate: Optional[threading.Event] = None
        self.fail_with: Optional[BaseException] = None
        self.calls = 0

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        self.calls += 1
        if self.gate is not None:
            self.gate.wait(30)
        if self.fail_with is not None:
            raise self.fail_with
        logits = self.inner(inputs, cache=cache)
        length = inputs.shape[1]
        end = cache[0].offset  # per-row position after this forward
        end = mx.broadcast_to(mx.array(end), (inputs.shape[0],)) if not isinstance(end, mx.array) or end.ndim == 0 else end
        positions = end[:, None] - length + mx.arange(length)[None]
        nxt = self.script[(positions + 1) % self.script.size]
        return mx.where(mx.arange(self.vocab_size)[None, None] == nxt[..., None], 100.0, -100.0).astype(logits.dtype)


class EchoingModel:
    """Wraps a real model and lifts each position's input token to ``margin`` above that
    position's best logit: a greedy row without penalties repeats its last token, one whose
    penalties count that token moves on."""

    def __init__(self, inner: Any, margin: float) -> None:
        self.inner = inner
        self.layers = inner.layers
        self.margin = margin

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        logits = self.inner(inputs, cache=cache)
        echoed = mx.arange(logits.shape[-1])[None, None] == inputs[..., None]
        return mx.where(echoed, mx.max(logits, axis=-1, keepdims=True) + self.margin, logits)


class TokenCostModel:
    """Wraps a real model and sleeps ``seconds_per_token`` for every input token of each
    forward, so a long prefill takes long enough to observe what happens meanwhile.
    ``tokens`` counts the input tokens computed (batch x length, padding included)."""

    def __init__(self, inner: Any, seconds_per_token: float) -> None:
        self.inner = inner
        self.layers = inner.layers
        self.seconds_per_token = seconds_per_token
        self.tokens = 0

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        n = inputs.shape[0] * inputs.shape[1]
        self.tokens += n
        time.sleep(n * self.seconds_per_token)
        return self.inner(inputs, cache=cache)


async def max_gap_while(work: Any) -> float:
    """The longest pause of a 5 ms ticker on this loop while ``work`` runs."""
    gaps, done = [0.0], asyncio.Event()

    async def ticker() -> None:
        last = time.monotonic()
        while not done.is_set():
            await asyncio.sleep(0.005)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    task = asyncio.ensure_future(ticker())
    await asyncio.sleep(0.02)
    try:
        await work
    finally:
        done.set()
        await task
    return max(gaps)


T = TypeVar("T")


def sampled_while(sample: Callable[[], T], work: Callable[[], Awaitable[Any]], period_s: float = 0.01) -> list[T]:
    """``sample()`` every ``period_s`` on a thread while ``asyncio.run(work())`` runs."""
    seen: list[T] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            seen.append(sample())
            time.sleep(period_s)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        asyncio.run(work())
    finally:
        done.set()
        watcher.join()
    return seen


def peak_memory_above_now(step: Callable[[], Any]) -> int:
    """MLX's peak memory (bytes) while ``step`` runs and its arrays are evaluated, above what
    was held before it."""
    mx.synchronize()
    held = mx.get_active_memory()
    mx.reset_peak_memory()
    step()
    mx.synchronize()
    return mx.get_peak_memory() - held


def scrape(engine: Any, prefix: str = "vllm:") -> dict[str, float]:
    """One Prometheus scrape of ``engine`` alone (:class:`EngineCollector`): sample name with
    labels -> value."""
    import prometheus_client
    from prometheus_client.parser import text_string_to_metric_families

    from mlx_parallm_provider.engine.prometheus import EngineCollector

    registry = prometheus_client.CollectorRegistry()
    registry.register(EngineCollector(engines=lambda: [engine], prefix=prefix))
    text = prometheus_client.generate_latest(registry).decode()
    return {f"{s.name}{dict(s.labels)}": s.value for fam in text_string_to_metric_families(text) for s in fam.samples}


def mlx_lm_greedy(loaded: Any, prompts: list[list[int]], params: Any, max_kv_size: Optional[int] = None) -> list[list[int]]:
    """mlx-lm's ``generate_step`` on each prompt alone, over a cache per layer as the engine
    windows it (``max_kv_size`` bounds every layer, keeping none of the first tokens; a hybrid
    model's recurrent layers get mlx-lm's ``ArraysCache``), the model on MLX's own ops."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

    from mlx_parallm_provider.engine.kv.support import layer_windows, recurrent_layers, with_max_kv_size
    from mlx_parallm_provider.models import backends

    windows = with_max_kv_size(layer_windows(loaded.model), max_kv_size)
    recurrent = recurrent_layers(loaded.model)
    out = []
    with backends.using(loaded.model, "mlx"):
        for prompt in prompts:
            attention = iter([KVCache() if w is None else RotatingKVCache(max_size=w, keep=0) for w in windows])
            cache = [ArraysCache(recurrent[layer]) if layer in recurrent else next(attention)
                     for layer in range(len(windows) + len(recurrent))]
            steps = generate_step(mx.array(prompt), loaded.model, max_tokens=params.max_tokens,
                                  sampler=lambda x: mx.argmax(x, axis=-1), prompt_cache=cache)
            out.append([int(t) for t, _ in steps])
    return out


def paged_kernel_calls(monkeypatch: Any) -> list:
    """Record each call of the paged CPU attention kernel (``attention.paged_decode_attention``):
    the list of its results, None where it did not apply (the caller then gathered)."""
    from mlx_parallm_provider.models import attention

    results: list = []
    kernel = attention.paged_decode_attention

    def counted(*args: Any, **kwargs: Any) -> Any:
        results.append(kernel(*args, **kwargs))
        return results[-1]

    monkeypatch.setattr(attention, "paged_decode_attention", counted)
    return results


def run_clients(client: Callable[[Any], None], args: Sequence[Any], timeout: Optional[float] = None) -> list[BaseException]:
    """``client(arg)`` on a thread each, all at once; the errors they raised."""
    errors: list[BaseException] = []

    def run(arg: Any) -> None:
        try:
            client(arg)
        except BaseException as exc:  # pragma: no cover (returned to the test)
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(arg,)) for arg in args]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    return errors


class PagedPieces:
    """``prompts`` fed to ``model`` in right-padded pieces over paged KV (the blocks of ``kv``,
    the arrays of ``storage``; each layer's attention ``windows``, None: all tokens), as the
    runner feeds them; each row's logits kept in ``got``."""

    def __init__(self, model: Any, prompts: list[list[int]], kv: Any, storage: Any, windows: Optional[list[Optional[int]]] = None) -> None:
        self.model, self.prompts, self.kv, self.storage, self.windows = model, prompts, kv, storage, windows
        self.done = [0] * len(prompts)
        self.got: list[list[mx.array]] = [[] for _ in prompts]

    def run(self, rows: list[int], width: int) -> None:
        """The next ``width`` tokens (at most) of each of ``rows`` through the model in one pass."""
        from mlx_parallm_provider.engine.kv.paged_cache import PagedBatch

        done = self.done
        pieces = [self.prompts[b][done[b] : done[b] + width] for b in rows]
        for b, piece in zip(rows, pieces):
            self.kv.grow(b, done[b] + len(piece))
        self.storage.reserve(self.kv.pool.high_water())
        batch = PagedBatch(self.storage, [self.kv.table(b) for b in rows], [done[b] for b in rows], [len(p) for p in pieces], width,
                           self.windows)
        logits = self.model(mx.array([p + [0] * (width - len(p)) for p in pieces]), cache=batch.layers())
        for i, (b, piece) in enumerate(zip(rows, pieces)):
            self.got[b].append(logits[i, : len(piece)])
            done[b] += len(piece)

    def decode_to_the_end(self) -> None:
        """One token a pass for every row not yet through its prompt, as decode steps run."""
        while any(d < len(p) for d, p in zip(self.done, self.prompts)):
            self.run([b for b, (d, p) in enumerate(zip(self.done, self.prompts)) if d < len(p)], 1)
