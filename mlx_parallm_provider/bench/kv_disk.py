"""The prefix store's disk tier across processes, measured in one run.

    python -m mlx_parallm_provider.bench.kv_disk [--model default] [--prompt-tokens 4000]
        [--requests 300] [--disk-gb 0.25] [--kv-cache-dtype auto]

Every step runs in a process of its own, as a restarted server or another replica would:

1. ``cold``: an agent prompt (a system prompt and tool schemas, ``--prompt-tokens`` long)
   answered with an empty ``kv_disk_path``; the process exits.
2. ``warm``: a new process on that folder answers another question on the same prefix: its
   TTFT against a cold run of that question (3, a process without a disk tier),
   ``cached_tokens``, and its greedy answer against the cold one's.
4. ``damaged``: one of the prefix's block files truncated, then (another process) one with a
   bit flipped: each skipped and counted, the answer still the cold one.
5. ``killed``: a process SIGKILLed while it writes a new prefix's blocks; the next process
   on the folder answers on that prefix without error.
6. ``churn``: ``--requests`` random agent requests (20 prefixes, random questions, 8 at a
   time) with ``kv_disk_gb`` = ``--disk-gb``: the folder's size after each answer, at most
   the bound.

Targets: warm TTFT <= 0.15x cold, cached_tokens >= prompt - 100, identical answers, damaged
files counted and never served, the folder within its bound.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Sequence

MAX_TOKENS = 24


def _tools(n: int) -> list[dict[str, Any]]:
    """``n`` tool schemas, each a function with a few typed parameters (an agent's toolbox)."""
    kinds = ["string", "integer", "number", "boolean"]
    return [{"type": "function", "function": {
        "name": f"tool_{i}_{['search', 'fetch', 'update', 'summarize', 'convert'][i % 5]}",
        "description": f"Tool {i}: {['searches the index', 'fetches a record', 'updates an entry', 'summarizes a text', 'converts units'][i % 5]}"
                       f" for the agent; use it when the user asks about item group {i} and only then.",
        "parameters": {"type": "object", "properties": {
            f"arg_{j}": {"type": kinds[(i + j) % 4], "description": f"argument {j} of tool {i}, as the user gave it"} for j in range(4)},
            "required": ["arg_0"]}}} for i in range(n)]


def agent_prompt(tokenizer: Any, target: int, seed: int, question: str) -> list[int]:
    """A chat prompt of about ``target`` tokens: a system prompt listing tool schemas (as JSON,
    one a line, as many as bring the prompt to ``target`` whatever the question), then a user
    ``question``."""
    system = (f"You are agent {seed}, a careful assistant for a logistics company. Answer briefly, cite the tool you used, "
              "never invent data, and ask for missing arguments. You can call these tools:\n")

    def ids(n: int, text: str) -> list[int]:
        tools = "\n".join(json.dumps(tool) for tool in _tools(n))
        messages = [{"role": "system", "content": system + tools}, {"role": "user", "content": text}]
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))

    n = 1
    while len(ids(n, "?")) < target and n < 1000:
        n += max(1, (target - len(ids(n, "?"))) // 400)
    return ids(n, question)


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.kvb") if p.exists())


# -- the child processes ----------------------------------------------------------------------


def child(args: argparse.Namespace) -> dict[str, Any]:
    from ..config import EngineConfig
    from ..engine import Engine, SamplingParams

    config: dict[str, Any] = {"kv_cache_dtype": args.kv_cache_dtype}
    if args.folder:
        config.update(kv_disk_path=args.folder, kv_disk_gb=args.disk_gb)
    engine = Engine(args.model, EngineConfig(**config))
    tokenizer = engine.tokenizer
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    engine.generate_sync([tokenizer.eos_token_id or 0] * 4, SamplingParams(max_tokens=1))  # the core up, the model warm
    result: dict[str, Any] = {}
    if args.child == "churn":
        import asyncio

        rng, folder, sizes = random.Random(0), Path(args.folder), []
        prefixes = [agent_prompt(tokenizer, rng.randint(300, 1500), 100 + g, "Q")[:-8] for g in range(20)]

        async def one(i: int) -> None:
            ids = rng.choice(prefixes) + tokenizer.encode(f" question {rng.randint(0, 10**6)}?")
            await engine.generate(ids, SamplingParams(max_tokens=8, temperature=0.0))
            sizes.append(_folder_bytes(folder))

        async def run() -> None:
            gate = asyncio.Semaphore(8)

            async def gated(i: int) -> None:
                async with gate:
                    await one(i)

            await asyncio.gather(*(gated(i) for i in range(args.requests)))

        asyncio.run(run())
        engine.shutdown()
        result.update(max_folder_bytes=max(sizes), final_folder_bytes=_folder_bytes(folder), answered=len(sizes))
        result["bound_bytes"] = int(args.disk_gb * 1024**3)
        return result
    ids = agent_prompt(tokenizer, args.prompt_tokens, args.seed, args.question)
    if args.damage:  # one of the prefix's block files: which one, from the tier's own names
        tier = engine._core.memory.disk  # noqa: SLF001
        names = tier.names(ids, len(ids) // engine.config.kv_block_size, engine.config.kv_block_size)
        path = tier.path(names[len(names) // 2])
        data = bytearray(path.read_bytes())
        if args.damage == "truncate":
            path.write_bytes(bytes(data[: len(data) // 3]))
        else:
            data[len(data) // 2] ^= 0x04
            path.write_bytes(bytes(data))
    if args.child == "killed":
        print("writing", flush=True)
    tic, ttft, tokens = time.perf_counter(), None, []
    for delta in engine.stream_sync(ids, greedy):
        if ttft is None:
            ttft = time.perf_counter() - tic
        tokens.extend(delta.token_ids)
    stats = engine.stats()
    engine.shutdown()
    result.update(ttft_s=ttft, tokens=tokens, prompt_tokens=len(ids), cached_tokens=stats["cached_prompt_tokens"],
                  kv_disk=stats["kv_disk"], kv_tiers=stats["kv_tiers"], kv_bytes_per_token=stats["kv_cache"].get("kv_bytes_per_token"))
    return result


# -- the parent -------------------------------------------------------------------------------


def _run(args: argparse.Namespace, phase: str, folder: Optional[str], **more: Any) -> dict[str, Any]:
    command = [sys.executable, "-m", "mlx_parallm_provider.bench.kv_disk", "--child", phase, "--model", args.model,
               "--prompt-tokens", str(args.prompt_tokens), "--kv-cache-dtype", args.kv_cache_dtype, "--disk-gb", str(args.disk_gb),
               "--requests", str(args.requests), "--folder", folder or ""]
    for key, value in more.items():
        command += [f"--{key.replace('_', '-')}", str(value)]
    out = subprocess.run(command, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{phase} failed:\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["warnings"] = [line for line in out.stderr.splitlines() if "KV disk tier" in line]
    return result


def _killed(args: argparse.Namespace, folder: str) -> dict[str, Any]:
    """Start a process on a new prefix, SIGKILL it once its block files appear."""
    command = [sys.executable, "-m", "mlx_parallm_provider.bench.kv_disk", "--child", "killed", "--model", args.model,
               "--prompt-tokens", str(args.prompt_tokens), "--kv-cache-dtype", args.kv_cache_dtype, "--disk-gb", str(args.disk_gb),
               "--folder", folder, "--seed", "2", "--question", "What does tool 3 do?"]
    before = set(Path(folder).glob("*.kvb"))
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert process.stdout is not None and process.stdout.readline().strip() == "writing"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and process.poll() is None and len(set(Path(folder).glob("*.kvb")) - before) < 8:
        time.sleep(0.002)
    process.send_signal(signal.SIGKILL)
    process.wait()
    new = len(set(Path(folder).glob("*.kvb")) - before)
    temps = len(list(Path(folder).glob(".*.tmp")))
    after = _run(args, "answer", folder, seed=2, question="Which tool converts units?")
    return {"files_when_killed": new, "temporaries_left": temps, "next_answer_tokens": len(after["tokens"]),
            "next_corrupt": after["kv_disk"]["corrupt"], "next_cached_tokens": after["cached_tokens"]}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--prompt-tokens", type=int, default=4000)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--disk-gb", type=float, default=0.25)
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    parser.add_argument("--folder", default="", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--question", default="Which tool fetches a record?", help=argparse.SUPPRESS)
    parser.add_argument("--damage", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0

    big_gb = max(args.disk_gb, 4.0)
    report: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kv-disk-") as root:
        folder = str(Path(root) / "tier")
        args.disk_gb, churn_gb = big_gb, args.disk_gb
        first = _run(args, "answer", folder, question="Which tool fetches a record?")
        warm = _run(args, "answer", folder, question="Which tool summarizes a text?")
        cold = _run(args, "answer", None, question="Which tool summarizes a text?")
        report["cold_first"] = {k: first[k] for k in ("ttft_s", "prompt_tokens", "cached_tokens", "kv_bytes_per_token")}
        report["files_after_first"] = len(list(Path(folder).glob("*.kvb")))
        report["warm"] = {"ttft_s": warm["ttft_s"], "cached_tokens": warm["cached_tokens"], "disk_hits": warm["kv_disk"]["hits"],
                          "bytes_read": warm["kv_disk"]["bytes_read"]}
        report["cold_reference_ttft_s"] = cold["ttft_s"]
        report["warm_over_cold_ttft"] = warm["ttft_s"] / cold["ttft_s"]
        report["warm_answer_identical"] = warm["tokens"] == cold["tokens"]
        for how in ("truncate", "flip"):
            damaged = _run(args, "answer", folder, question="Which tool summarizes a text?", damage=how)
            report[f"damaged_{how}"] = {"corrupt_counted": damaged["kv_disk"]["corrupt"], "answer_identical": damaged["tokens"] == cold["tokens"],
                                        "cached_tokens": damaged["cached_tokens"], "warnings": damaged["warnings"][:2]}
        report["killed_while_writing"] = _killed(args, folder)
        args.disk_gb = churn_gb
        churn_folder = str(Path(root) / "churn")
        report["churn"] = _run(args, "churn", churn_folder)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
