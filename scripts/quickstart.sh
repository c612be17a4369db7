#!/usr/bin/env bash
# One command on a fresh machine: install, then run the main example on the default model.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
# LiteLLM's bundled model cost map: no download attempt (and no warnings or retries) at import.
export LITELLM_LOCAL_MODEL_COST_MAP=True
exec .venv/bin/python examples/quickstart.py "$@"
