#!/usr/bin/env bash
# The Gradio chat page in front of a running server (start one with `.venv/bin/minicpmo-serve --port 8099`).
#   bash examples/online_serving/minicpmo/run_gradio_demo.sh [--api-base URL] [--model NAME] [--port 7862] [...]
# Every argument goes to gradio_demo.py; the defaults below are used when not given. Needs the dev extras
# (gradio is pinned there): bash scripts/setup.sh.
set -euo pipefail
cd "$(dirname "$0")/../../.."
PY=${PYTHON:-.venv/bin/python}
exec "$PY" -m examples.online_serving.minicpmo.gradio_demo \
  --api-base "${MINICPMO_API_BASE:-http://127.0.0.1:8099/v1}" --port "${GRADIO_PORT:-7862}" "$@"
