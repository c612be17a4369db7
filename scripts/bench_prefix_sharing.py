"""Prefix-sharing benchmark: the agent workload with prefix caching off, then on, in one run.

32 concurrent requests share one long system prompt and three tool schemas (rendered by
the model's chat template, ~600 tokens) and differ only by a short user question; greedy,
``max_tokens=48``. For each mode it prints TTFT p50/p99, wall time, prompt tokens actually
prefilled, the median decode step and MLX peak memory; with caching on it then runs a
second wave (new questions, same prefix) to show reuse across time.

    .venv/bin/python scripts/bench_prefix_sharing.py [--model default] [--requests 32] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import time
from typing import Any

import mlx_parallm_provider.models  # noqa: F401  (preloads BLAS before mlx)

# isort: split
import mlx.core as mx

from mlx_parallm_provider.chat import render_chat
from mlx_parallm_provider.config import EngineConfig
from mlx_parallm_provider.engine import Engine, SamplingParams
from mlx_parallm_provider.models import registry

SYSTEM = (
    "You are Atlas, the operations assistant of Northwind Logistics. You help dispatchers, "
    "warehouse leads and customer-support agents with shipments, inventory, schedules and "
    "customer questions. Follow these rules in every answer. Be concise: answer in at most "
    "three sentences unless the user asks for detail. Never invent shipment numbers, "
    "tracking codes, prices or dates; when you need one, call a tool. When a question needs "
    "live data (weather on a route, the local time at a depot, the status of an order), call "
    "the matching tool with precise arguments instead of guessing. Use metric units, 24-hour times and ISO "
    "dates (YYYY-MM-DD). "
    "Keep personal data private: never repeat a customer's phone number or "
    "email in full. If you are unsure, ask one short clarifying question."
)

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather and the next 12 hours' forecast for a city on a route.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "City name, e.g. Hamburg"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "Temperature unit"}},
            "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "get_local_time", "description": "Local date and time at one of the depots.",
        "parameters": {"type": "object", "properties": {
            "depot": {"type": "string", "enum": ["RTM", "HAM", "LYS", "MXP", "WAW", "MAD"], "description": "Depot code"}},
            "required": ["depot"]}}},
    {"type": "function", "function": {
        "name": "get_order_status", "description": "Status, position and expected delivery of a customer order.",
        "parameters": {"type": "object", "properties": {
            "order_id": {"type": "string", "description": "Order number, e.g. NW-2024-00042"},
            "include_history": {"type": "boolean", "description": "Whether to include every scan event"}},
            "required": ["order_id"]}}},
]

QUESTIONS = [
    "What's the weather in Hamburg right now?", "What time is it at the Milan depot?",
    "Where is order NW-2024-00042?", "Can I still change the address of order NW-2024-00107?",
    "Is it raining in Lyon?", "When does the Warsaw depot open tomorrow?",
    "How cold will it be in Madrid tonight?", "Has order NW-2024-00311 left the depot?",
    "What is the local time in Rotterdam?", "Do hazardous goods need paperwork?",
    "Give me the status of order NW-2024-00999 with history.", "Is the Hamburg depot open now?",
    "Will there be snow near Warsaw today?", "How fast must a priority order leave?",
    "What is the redirection fee?", "Is it windy in Rotterdam?",
]


def agent_prompts(engine: Engine, n: int, wave: int = 0) -> list[list[int]]:
    """Token ids of ``n`` chat prompts: the shared system prompt + tools, one question each."""
    out = []
    for i in range(n):
        q = QUESTIONS[i % len(QUESTIONS)] + (f" (request {wave}-{i})" if n > len(QUESTIONS) or wave else "")
        text = render_chat(engine.tokenizer, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}], tools=TOOLS)
        out.append(engine.encode(text))
    return out


async def _wave(engine: Engine, prompts: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    tic = time.perf_counter()
    await asyncio.gather(*(engine.generate(p, params) for p in prompts))
    return time.perf_counter() - tic


def run_mode(loaded: Any, prompts: list[list[int]], second: list[list[int]], max_tokens: int, sharing: bool) -> dict:
    engine = Engine("default", EngineConfig(enable_prefix_caching=sharing), loaded=loaded)
    gc.collect()
    mx.clear_cache()
    mx.reset_peak_memory()
    idle = mx.get_active_memory()
    wall = asyncio.run(_wave(engine, prompts, max_tokens))
    stats = engine.stats()
    result = {
        "prefix_caching": sharing,
        "wall_s": wall,
        "ttft_p50_s": stats["ttft_s"]["p50"],
        "ttft_p99_s": stats["ttft_s"]["p99"],
        "prompt_tokens": stats["prompt_tokens"],
        "prefilled_prompt_tokens": stats["prefilled_prompt_tokens"],
        "decode_step_p50_s": stats["step_s"]["p50"],
        "max_batch_size": stats["max_batch_size"],
        "output_tok_per_s": stats["generated_tokens"] / wall,
        "mlx_peak_mb": (mx.get_peak_memory() - idle) / 1e6,
        "prefix_cache": stats["prefix_cache"],
    }
    if sharing:
        engine.metrics.reset()
        result["second_wave"] = {
            "wall_s": asyncio.run(_wave(engine, second, max_tokens)),
            "prefilled_prompt_tokens": engine.stats()["prefilled_prompt_tokens"],
            "ttft_p50_s": engine.stats()["ttft_s"]["p50"],
        }
    engine.shutdown()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()

    loaded = registry.load(args.model)
    warm = Engine(args.model, EngineConfig(enable_prefix_caching=False), loaded=loaded)
    prompts = agent_prompts(warm, args.requests)
    second = agent_prompts(warm, args.requests, wave=1)
    warm.generate_sync("Hello", SamplingParams(max_tokens=4))
    warm.shutdown()
    shared = min(len(p) for p in prompts)
    print(f"agent workload: {args.requests} requests, prompts {shared}-{max(len(p) for p in prompts)} tokens, "
          f"greedy, max_tokens={args.max_tokens}, model {args.model}")

    off = run_mode(loaded, prompts, second, args.max_tokens, sharing=False)
    on = run_mode(loaded, prompts, second, args.max_tokens, sharing=True)
    rows = [
        ("TTFT p50 (s)", "ttft_p50_s", "{:.2f}"), ("TTFT p99 (s)", "ttft_p99_s", "{:.2f}"),
        ("wall (s)", "wall_s", "{:.2f}"), ("output tok/s", "output_tok_per_s", "{:.1f}"),
        ("prompt tokens", "prompt_tokens", "{}"), ("prompt tokens prefilled", "prefilled_prompt_tokens", "{}"),
        ("decode step p50 (ms)", "decode_step_p50_s", "{:.0f}"), ("largest decode batch", "max_batch_size", "{}"),
        ("MLX peak over idle (MB)", "mlx_peak_mb", "{:.0f}"),
    ]
    print(f"{'':26}{'sharing off':>14}{'sharing on':>14}{'off/on':>9}")
    for label, key, fmt in rows:
        a, b = off[key], on[key]
        if key == "decode_step_p50_s":
            a, b = a * 1000, b * 1000
        ratio = f"{a / b:.1f}x" if isinstance(a, (int, float)) and b else ""
        print(f"{label:26}{fmt.format(a):>14}{fmt.format(b):>14}{ratio:>9}")
    w2 = on["second_wave"]
    print(f"second wave (sharing on, same prefix, new questions): {w2['prefilled_prompt_tokens']} prompt tokens prefilled "
          f"({w2['prefilled_prompt_tokens'] / on['prompt_tokens']:.1%} of the first wave's {on['prompt_tokens']}), "
          f"TTFT p50 {w2['ttft_p50_s']:.2f} s, wall {w2['wall_s']:.2f} s")
    print(f"prefix cache: {json.dumps(on['prefix_cache'])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"off": off, "on": on}, f, indent=2)


if __name__ == "__main__":
    main()
