#!/usr/bin/env bash
# One command on a fresh machine: install with the test tools, then run every test
# (the few `slow` ones use the real default model). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh --dev
export LITELLM_LOCAL_MODEL_COST_MAP=True
exec .venv/bin/python -m pytest "$@"
