"""``mlx-parallm bench``: a serving benchmark of this package's front doors and its peers,
on the same requests, in one run.

    mlx-parallm bench                                  # chat workload, 1/8/32 concurrent
    mlx-parallm bench --workload agent --slo ttft=2000,tpot=200 --sweep max_num_seqs=8,16,32
    mlx-parallm bench --systems http --url http://127.0.0.1:4000/v1 --api-key sk-...
    mlx-parallm bench --quick                           # a smoke test: tiny run, every output

Prints a markdown table; writes ``results.json`` and PNG plots under ``--output-dir``
(default ``./bench-results/<time>/``). Metrics are defined as in vLLM's serving benchmark
(see :mod:`mlx_parallm_provider.bench.metrics`).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import platform
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any, Optional

from ..config import default_environment, env_text
from . import metrics, plots, report, servers, sweep, workloads
from .arrivals import arrival_offsets
from .progress import Progress
from .runners import DESCRIPTIONS, OURS, SYSTEMS, RunnerOptions, Sampling, SkipSystem, make_runner
from .runners.llama_cpp import default_threads

DEFAULT_SYSTEMS = ("engine", "litellm", "langchain", "mlx-lm", "mlx-lm-batch", "mlx-lm-server", "llama-cpp")
QUICK_SYSTEMS = ("engine", "litellm", "langchain", "mlx-lm", "mlx-lm-batch", "llama-cpp")


def _fraction(low_open: bool) -> Any:
    """A float in (0, 1] (``low_open``) or [0, 1], for argparse."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not (0.0 < value <= 1.0 if low_open else 0.0 <= value <= 1.0):
            raise argparse.ArgumentTypeError(f"expected a number in {'(0, 1]' if low_open else '[0, 1]'}, got {value}")
        return value

    return parse


def _sampling(args: argparse.Namespace) -> Sampling:
    """How every request of the run samples (--temperature, --top-p, --top-k, --min-p)."""
    return Sampling(args.temperature, args.top_p, args.top_k, args.min_p)


def _count(text: str) -> int:
    """An integer >= 0, for argparse."""
    return 0 if text.strip() == "0" else _positive_int(text)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def _int_list(text: str) -> list[int]:
    values = [_positive_int(v) for v in text.split(",") if v.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    return values


def _systems(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in names if s not in SYSTEMS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown system(s) {', '.join(unknown) or text!r}: choose from {', '.join(SYSTEMS)}")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``bench`` subcommand's options."""
    a = parser.add_argument
    a("--model", default="default", help="'default', a .gguf, an mlx-lm folder or a repo id")
    a("--systems", type=_systems, help=f"comma-separated, from: {', '.join(SYSTEMS)} (default: {','.join(DEFAULT_SYSTEMS)})")
    a("--workload", default="chat", help="chat | agent | long | a .jsonl file of OpenAI-style requests")
    a("--num-prompts", type=_positive_int, help="prompts per run (default: the concurrency level)")
    a("--n", type=_positive_int, default=1, help="samples per prompt (sent as n requests arriving together)")
    a("--tool-choice", choices=("auto", "required"), help="tool_choice sent with the tools of the agent workload (litellm, langchain, "
      "http; default: none sent, i.e. auto); 'required' makes every answer a constrained tool call")
    a("--max-tokens", type=_positive_int, help="new tokens per request (default 64; 8 with --quick)")
    a("--temperature", type=float, default=0.0)
    a("--top-p", type=_fraction(low_open=True), default=1.0, help="nucleus filter of every request (default 1: off)")
    a("--top-k", type=_count, default=0, help="keep each step's k likeliest tokens (default 0: off)")
    a("--min-p", type=_fraction(low_open=False), default=0.0, help="drop tokens below min_p x the likeliest's probability (default 0: off)")
    a("--ignore-eos", action="store_true", help="generate max-tokens every time (systems that can; the EOS column says)")
    a("--max-prompt-len", type=_positive_int, default=1024, help="longest prompt of the 'long' workload, in tokens")
    a("--concurrency", "--max-concurrency", type=_int_list, help="most requests in flight, one run per level (default 1,8,32; 1,4 with --quick)")
    a("--request-rate", type=float, default=math.inf, help="Poisson arrivals at this many requests/s (default: all at once)")
    a("--burstiness", type=float, default=1.0, help="gamma shape of the arrival gaps: 1 is Poisson, <1 burstier, >1 steadier")
    a("--seed", type=int, default=0, help="seed of the arrival times")
    a("--slo", help="goodput SLO in ms, e.g. ttft=500,tpot=50 (also e2el)")
    a("--sweep", action="append", default=[], metavar="NAME=V1,V2", help=f"try each value; NAME: {', '.join(sweep.SWEEPABLE)}")
    a("--percentiles", type=_int_list, default=list(metrics.PERCENTILES), help="latency percentiles (default 50,90,99)")
    a("--url", help="OpenAI-compatible server for system 'http' (with or without /v1)")
    a("--api-key", default=env_text("OPENAI_API_KEY") or None, help="bearer key for --url (default $OPENAI_API_KEY)")
    a("--served-model", help="model name to send to --url (default: --model)")
    a("--llama-cpp-threads", type=_positive_int, help="threads of the llama-cpp and llama-server peers (default: half the CPUs, as llama-cpp-python)")
    a("--output-dir", type=Path, help="where results.json and the plots go (default ./bench-results/<time>/)")
    a("--quick", action="store_true", help="a smoke test: chat, concurrency 1,4, 8 tokens, in-process systems")
    a("--no-progress", action="store_true", help="no progress bar")


def _meta(args: argparse.Namespace, systems: list[str], levels: list[int], slo: dict[str, float]) -> dict[str, Any]:
    from .. import __version__
    from ..doctor import device_name
    from ..models import backend

    def version(dist: str) -> Optional[str]:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    return {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "model": args.model, "workload": args.workload,
        "systems": systems, "concurrency": levels, "num_prompts": args.num_prompts, "n": args.n,
        "max_tokens": args.max_tokens, "tool_choice": args.tool_choice, "temperature": args.temperature,
        "top_p": args.top_p, "top_k": args.top_k, "min_p": args.min_p, "ignore_eos": args.ignore_eos,
        "request_rate": None if math.isinf(args.request_rate) else args.request_rate, "burstiness": args.burstiness,
        "slo_ms": slo, "sweep": args.sweep, "percentiles": args.percentiles,
        "llama_cpp_threads": args.llama_cpp_threads or default_threads(),
        "machine": {"platform": platform.platform(), "machine": platform.machine(), "cpus": os.cpu_count(), "blas": backend.blas_in_use(),
                    "device": device_name()},
        "versions": {"mlx-parallm-provider": __version__,  # the code running (a checkout on PYTHONPATH has no metadata)
                     **{d: version(d) for d in ("mlx", "mlx-lm", "litellm", "langchain-core", "llama-cpp-python")}},
    }


async def _bench(args: argparse.Namespace, systems: list[str], levels: list[int], settings: list[dict], slo: dict[str, float],
                 out_dir: Path) -> tuple[list[dict[str, Any]], dict[str, str], dict[str, Any]]:
    from .. import Engine, EngineConfig

    engine = await asyncio.to_thread(Engine, args.model)  # the chat template and tokenizer; no worker starts
    renderer = workloads.ChatRenderer(engine)
    max_prompt_len = max(16, min(args.max_prompt_len, engine.context_length - args.max_tokens - 64))
    requests = {
        c: workloads.prepare(
            workloads.build(args.workload, args.num_prompts or c, args.max_tokens, tokenizer=engine.tokenizer,
                            max_prompt_len=max_prompt_len, n=args.n, tool_choice=args.tool_choice),
            renderer,
        )
        for c in levels
    }
    options = RunnerOptions(model=args.model, sampling=_sampling(args), ignore_eos=args.ignore_eos, workdir=out_dir,
                            url=args.url, api_key=args.api_key, served_model=args.served_model,
                            llama_cpp_threads=args.llama_cpp_threads, max_concurrency=max(levels))
    rows: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    started: list[tuple[str, dict, Any]] = []
    try:
        for system in systems:
            for setting in settings if system in OURS else [{}]:
                try:
                    runner = make_runner(system, options, EngineConfig(**setting))
                    await runner.start()
                except Exception as exc:  # SkipSystem, or a peer that cannot start: one line, no traceback
                    skipped[system] = str(exc) if isinstance(exc, SkipSystem) else f"could not start: {type(exc).__name__}: {exc}"
                    print(f"skipping {system}: {skipped[system]}", file=sys.stderr)
                    break
                started.append((system, setting, runner))
        meta = _meta(args, systems, levels, slo)  # (the BLAS is bound once an engine has loaded)
        # Level by level, every system in turn: drift in the machine's load hits all alike.
        for c in levels:
            batch = requests[c]
            offsets = arrival_offsets([r.group for r in batch], args.request_rate, args.burstiness, args.seed)
            for order, (system, setting, runner) in enumerate(started):
                with Progress(len(batch), f"{system} {sweep.label(setting)} c={c}", enabled=not args.no_progress) as tick:
                    records, duration = await runner.run(batch, offsets, c, tick)
                m = metrics.compute(records, duration, slo, args.percentiles)
                m.update({"max_decode_batch": None, "peak_memory_mb": None, "peak_rss_mb": None, "backend": None, "attention": None,
                          "decode": None,
                          **runner.run_info()})
                rows.append({
                    "order": order, "system": system, "description": DESCRIPTIONS[system], "setting": setting,
                    "setting_label": sweep.label(setting), "concurrency": c, "num_requests": len(batch),
                    "eos": runner.eos, "metrics": m, "samples": metrics.samples(records),
                })
                # The runs measured so far, kept should the run be cut short (a time limit, ^C)
                # while a slower system takes its turn at this level.
                report.write_json(out_dir / "results.json", {"meta": meta, "rows": [{k: v for k, v in r.items() if k != "order"} for r in rows],
                                                             "skipped": skipped, "complete": False})
    finally:
        for _, _, runner in started:
            await runner.stop()
    rows.sort(key=lambda r: (r.pop("order"), r["concurrency"]))
    return rows, skipped, meta


def _best_lines(rows: list[dict[str, Any]], slo: dict[str, float], swept: bool) -> tuple[list[str], dict[str, Any]]:
    if not swept:
        return [], {}
    target = " and ".join(f"{k}<={v:g} ms" for k, v in slo.items()) or "output tok/s (no --slo)"
    lines, best = [], {}
    for system in dict.fromkeys(r["system"] for r in rows if r["system"] in OURS):
        top = sweep.best([r for r in rows if r["system"] == system])
        if top is None:
            continue
        m = top["metrics"]
        goodput = f"goodput {m['request_goodput']:.2f} req/s, " if m["request_goodput"] is not None else ""
        lines.append(f"best {system} setting for {target}: {top['setting_label']} at concurrency {top['concurrency']} "
                     f"({goodput}{m['output_throughput']:.1f} output tok/s)")
        best[system] = {"setting": top["setting"], "concurrency": top["concurrency"], "metrics": m}
    return lines, best


def run(args: argparse.Namespace) -> int:
    """Run the benchmark the parsed arguments describe; returns the exit status."""
    default_environment("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    from .. import EngineConfig, InvalidParameterError

    try:
        slo = metrics.parse_slo(args.slo)
        settings, swept_levels = sweep.parse(args.sweep)
        for setting in settings:
            EngineConfig(**setting)
        workloads.check_name(args.workload)
    except (ValueError, InvalidParameterError) as exc:
        print(f"mlx-parallm bench: error: {exc}", file=sys.stderr)
        return 2
    if args.max_tokens is None:
        args.max_tokens = 8 if args.quick else 64
    levels = swept_levels or args.concurrency or ([1, 4] if args.quick else [1, 8, 32])
    systems = args.systems or list(QUICK_SYSTEMS if args.quick else DEFAULT_SYSTEMS)
    out_dir = args.output_dir or Path("bench-results") / time.strftime("%Y%m%d-%H%M%S")
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        note = f"mlx-parallm bench: stopped, and the servers it started; the runs measured are in {out_dir / 'results.json'}"
        with servers.stopped_on_signal(note):
            rows, skipped, meta = asyncio.run(_bench(args, systems, levels, settings, slo, out_dir))
    except ValueError as exc:  # a bad workload, JSONL file or engine setting
        print(f"mlx-parallm bench: error: {exc}", file=sys.stderr)
        return 2
    best_lines, best = _best_lines(rows, slo, swept=len(settings) > 1 or (swept_levels is not None and len(levels) > 1))
    filters = "".join(f" {name}={value}" for name, value in _sampling(args).filters().items())
    print(f"model={args.model} workload={args.workload} max_tokens={args.max_tokens} temperature={args.temperature}{filters} "
          f"request_rate={args.request_rate} burstiness={args.burstiness} cpus={os.cpu_count()}\n")
    print(report.markdown_table(rows, show_goodput=bool(slo)))
    print()
    print(report.notes(rows, skipped, best_lines))
    result = {"meta": meta, "rows": rows, "skipped": skipped, "best": best, "complete": True}
    report.write_json(out_dir / "results.json", result)
    written = plots.write_plots(rows, out_dir)
    if not plots.available():
        print("- plots skipped: matplotlib is not installed (pip install 'mlx-parallm-provider[bench]')")
    print(f"\nresults: {out_dir / 'results.json'}" + "".join(f", {p.name}" for p in written))
    return 0 if rows else 1
