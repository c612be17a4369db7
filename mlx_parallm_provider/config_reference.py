"""The configuration reference (``docs/configuration.md``), generated from the configs themselves.

Each field of :class:`.EngineConfig` and :class:`.DeviceConfig` (as ``device.<name>``) gets
its type, default, allowed values (:data:`.config.ENGINE_SETTINGS` /
:data:`.config.DEVICE_SETTINGS`, what the validation reads), environment variable and the
description in its class docstring's ``Attributes:`` section; then the model pool's
:class:`.PoolConfig` and the process-wide variables (:data:`.config.PROCESS_VARIABLES`)::

    python -m mlx_parallm_provider.config_reference --write   # rewrites docs/configuration.md
    python -m mlx_parallm_provider.config_reference           # prints it
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any, Optional, Sequence

from .config import DEVICE_SETTINGS, ENGINE_SETTINGS, POOL_SETTINGS, PROCESS_VARIABLES, DeviceConfig, EngineConfig, PoolConfig, Setting

DOC_PATH = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"
COMMAND = "python -m mlx_parallm_provider.config_reference --write"


def attribute_docs(cls: type) -> dict[str, str]:
    """The ``Attributes:`` section of ``cls``'s Google-style docstring: field -> its text,
    continuation lines joined."""
    lines = (cls.__doc__ or "").expandtabs().splitlines()
    docs: dict[str, str] = {}
    inside, indent, name = False, None, None
    for line in lines:
        stripped = line.strip()
        if stripped == "Attributes:":
            inside = True
            continue
        if not inside:
            continue
        if not stripped:
            continue
        depth = len(line) - len(line.lstrip())
        if indent is None:
            indent = depth
        if depth < indent:
            break
        match = re.match(r"(\w+)(?: \([^)]*\))?: (.*)", stripped)
        if depth == indent and match:
            name = match.group(1)
            docs[name] = match.group(2)
        elif name is not None:
            docs[name] += " " + stripped
    return docs


def _markdown(text: str) -> str:
    """Docstring markup as Markdown: ``:role:`~a.b.C``` -> ```C```, ````x```` -> ```x```, ``|`` escaped."""
    text = re.sub(r":\w+:`~?([\w.]+)`", lambda m: f"`{m.group(1).split('.')[-1]}`", text)
    text = text.replace("``", "`")
    return text.replace("|", "\\|")


def _default(cls: type, name: str, setting: Optional[Setting]) -> str:
    field = next(f for f in fields(cls) if f.name == name)
    if field.default is not MISSING:
        value: Any = field.default
    elif setting is not None:
        value = setting.default
    else:
        return "see below"
    return f"`{value!r}`"


def _table(cls: type, settings: dict[str, Setting], prefix: str = "") -> list[str]:
    docs = attribute_docs(cls)
    rows = ["| Field | Type | Default | Allowed | Environment variable | Description |", "|---|---|---|---|---|---|"]
    for f in fields(cls):
        setting = settings.get(f.name)
        allowed = setting.limit.describe() if setting else "a DeviceConfig (or a mapping of its fields)"
        env = f"`{setting.env}`" if setting and setting.env else ""
        description = docs.get(f.name)
        if description is None:
            raise ValueError(f"{cls.__name__}.{f.name} has no description in the class docstring's Attributes section")
        rows.append(f"| `{prefix}{f.name}` | `{f.type}` | {_default(cls, f.name, setting)} | {_markdown(allowed)} | {env} | "
                    f"{_markdown(description)} |")
    return rows


def render() -> str:
    """The whole reference, as Markdown."""
    lines = [
        "# Configuration reference",
        "",
        f"<!-- Generated from mlx_parallm_provider/config/ by `{COMMAND}`; do not edit by hand. -->",
        "",
        "An engine's settings are an `EngineConfig`; how it computes on its device is its `device`, a",
        "`DeviceConfig`. A field's environment variable, where it has one, only gives its default: a",
        "value passed explicitly wins. A bad value passed explicitly raises `InvalidParameterError`; a",
        "bad value in the environment is logged as a warning and replaced by the built-in default (an",
        "integer out of range is clamped into it). Engines made without a config (`get_engine(name)`,",
        "every engine of a LiteLLM proxy) use `EngineConfig.from_env()`: `MLX_PARALLM_ENGINE_CONFIG`,",
        "then each field's own variable.",
        "",
        "```python",
        "from mlx_parallm_provider import DeviceConfig, EngineConfig, get_engine",
        "",
        "engine = get_engine(\"default\", EngineConfig(max_num_seqs=32, device=DeviceConfig(cpu_kernels=False)))",
        "```",
        "",
        "## EngineConfig",
        "",
        *_table(EngineConfig, ENGINE_SETTINGS),
        "",
        "## DeviceConfig (`EngineConfig.device`)",
        "",
        _markdown(re.sub(r"\s+", " ", (DeviceConfig.__doc__ or "").split("Attributes:")[0]).strip()),
        "",
        *_table(DeviceConfig, DEVICE_SETTINGS, "device."),
        "",
        "## PoolConfig (the process's model pool)",
        "",
        _markdown(re.sub(r"\s+", " ", (PoolConfig.__doc__ or "").split("Attributes:")[0]).strip()),
        "",
        "```python",
        "from mlx_parallm_provider import configure_pool",
        "",
        "configure_pool(memory_gb=8, idle_unload_s=600)",
        "```",
        "",
        *_table(PoolConfig, POOL_SETTINGS),
        "",
        "## Process-wide variables",
        "",
        "Read by the whole process, not a field of a config.",
        "",
        "| Variable | Meaning |",
        "|---|---|",
        *(f"| `{name}` | {_markdown(text)} |" for name, text in PROCESS_VARIABLES.items()),
        "",
    ]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Print the reference, or with ``--write`` write it to ``docs/configuration.md``."""
    parser = argparse.ArgumentParser(description="Render the configuration reference (Markdown).")
    parser.add_argument("--write", action="store_true", help=f"write it to {DOC_PATH}")
    args = parser.parse_args(argv)
    text = render()
    if args.write:
        DOC_PATH.write_text(text)
        print(f"wrote {DOC_PATH}")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
