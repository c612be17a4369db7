#!/usr/bin/env bash
# One command on a fresh machine: install with the test tools, lint, then run every test
# (the few `slow` ones use the real default model), listing the 15 slowest at the end (CI has
# a time budget). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh --dev
export LITELLM_LOCAL_MODEL_COST_MAP=True
# Line length, import order and pyflakes (pyproject.toml's [tool.ruff]) before the tests.
.venv/bin/ruff check .
exec .venv/bin/python -m pytest --durations=15 "$@"
