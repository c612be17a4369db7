"""Where a profiled process spent its time, from py-spy's raw output: per thread, the
functions its samples fall in (inclusive: anywhere on the stack) and end in (self).

    py-spy record --idle --threads --format raw -o profile.txt -- python -m ...
    python -m mlx_parallm_provider.bench.spy_summary profile.txt [--top 25]   # or profile.txt.gz

With ``--idle`` a thread's waits count too (the engine's worker waiting on the GPU shows as
the call that waits), so each thread's shares add up to its wall time sampled.
"""

from __future__ import annotations

import argparse
import gzip
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

_LINE_NUMBER = re.compile(r":\d+\)$")
_THREAD = re.compile(r"thread \((\w+)\)(?::\s*(.*))?$")
#: inclusive shares are listed for the functions of these packages (outer frames such as the
#: thread's bootstrap hold every sample and say nothing)
OWN_CODE = ("mlx_parallm_provider/", "mlx_lm/")
ENGINE_THREAD = "mlx-parallm-worker"  # engine.core.WORKER_THREAD_NAME, not imported: that loads MLX


@dataclass
class ThreadProfile:
    """One thread's samples: in total, by function anywhere on the stack and by the last one."""

    name: str
    samples: int = 0
    inclusive: Counter = field(default_factory=Counter)
    self_time: Counter = field(default_factory=Counter)


def parse(lines: Iterable[str]) -> dict[str, ThreadProfile]:
    """py-spy's raw (collapsed) lines, ``thread (id)[: name];frame;...;frame count``, by thread
    id; a frame is its function and file, its line number dropped."""
    threads: dict[str, ThreadProfile] = {}
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack or not count.isdigit():
            continue
        thread, *frames = stack.split(";")
        match = _THREAD.match(thread)
        key, name = (match.group(1), match.group(2)) if match else (thread, None)
        profile = threads.setdefault(key, ThreadProfile(f"thread {key}"))
        if name:  # py-spy names a thread once Python has
            profile.name = f"thread {key}: {name}"
        n = int(count)
        profile.samples += n
        functions = [_LINE_NUMBER.sub(")", f) for f in frames]
        for function in set(functions):
            profile.inclusive[function] += n
        if functions:
            profile.self_time[functions[-1]] += n
    return threads


def markdown(threads: dict[str, ThreadProfile], top: int = 25, min_share: float = 0.02, first: str = ENGINE_THREAD) -> str:
    """The threads holding at least ``min_share`` of all samples, those named with ``first``
    (the engine's worker) first, then the busiest: each one's ``top`` functions by self
    share and, of :data:`OWN_CODE`'s, by inclusive share, in % of that thread's samples."""
    total = sum(t.samples for t in threads.values()) or 1
    out = []
    for t in sorted(threads.values(), key=lambda t: (first not in t.name, -t.samples)):
        if t.samples / total < min_share:
            continue
        out.append(f"## {t.name}: {t.samples} samples ({100 * t.samples / total:.0f}% of all)\n")
        own = Counter({f: n for f, n in t.inclusive.items() if any(f"({p}" in f for p in OWN_CODE)})
        for title, counts in (("self", t.self_time), ("inclusive", own)):
            out.append(f"| {title} % | function |\n|---:|---|")
            out += [f"| {100 * n / t.samples:.1f} | {f} |" for f, n in counts.most_common(top)]
            out.append("")
    return "\n".join(out)


def main(argv: "list[str] | None" = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("raw", type=Path, help="py-spy record --format raw output (gzipped: a name ending .gz)")
    parser.add_argument("--top", type=int, default=25, help="functions listed per thread and table")
    args = parser.parse_args(argv)
    opener = gzip.open if args.raw.suffix == ".gz" else open
    with opener(args.raw, "rt", errors="replace") as lines:
        print(markdown(parse(lines), args.top))


if __name__ == "__main__":
    main()
