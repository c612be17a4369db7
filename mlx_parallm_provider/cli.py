"""The ``mlx-parallm`` command: ``convert`` a GGUF, ``generate`` text, ``bench`` serving,
``doctor`` (what models run on here)."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Optional, Sequence

from . import MLXParallmError


def _convert(args: argparse.Namespace) -> int:
    from .models.gguf import convert_gguf

    out = convert_gguf(args.gguf, args.out)
    print(f"converted {args.gguf} -> {out}")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from . import SamplingParams, get_engine
    from .chat import render_chat

    engine = get_engine(args.model)
    prompt = render_chat(engine.tokenizer, [{"role": "user", "content": args.prompt}])
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    for delta in engine.stream_sync(prompt, params):
        print(delta.text, end="", flush=True)
    print()
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from .doctor import main as doctor

    return doctor()


def _bench(args: argparse.Namespace) -> int:
    from .bench import command

    return command.run(args)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``mlx-parallm`` command."""
    parser = argparse.ArgumentParser(prog="mlx-parallm", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    convert = sub.add_parser("convert", help="convert a llama-family GGUF into an mlx-lm model folder")
    convert.add_argument("gguf", help="path of the .gguf file")
    convert.add_argument("out", help="output folder (must not exist, or be empty)")
    convert.set_defaults(func=_convert)

    generate = sub.add_parser("generate", help="answer one chat message")
    generate.add_argument("prompt")
    generate.add_argument("--model", default="default", help="'default', a .gguf, a folder or a repo id")
    generate.add_argument("--max-tokens", type=int, default=128)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.set_defaults(func=_generate)

    doctor = sub.add_parser("doctor", help="print the device, BLAS, CPU features, kernels, model cache and versions")
    doctor.set_defaults(func=_doctor)

    from .bench import command as bench_command

    bench = sub.add_parser(
        "bench", help="serving benchmark: front doors and peers side by side (table, JSON, plots)",
        description=bench_command.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench_command.add_arguments(bench)
    bench.set_defaults(func=_bench)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point; returns the process exit status. Known errors print one line, no traceback."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except MLXParallmError as exc:
        print(f"mlx-parallm: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
