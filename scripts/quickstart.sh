#!/usr/bin/env bash
# One command on a fresh machine: install, then run the main example on the default model.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
exec .venv/bin/python examples/quickstart.py "$@"
