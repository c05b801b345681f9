#!/usr/bin/env bash
# Install (scripts/setup.sh) and run the linter, the formatter check, the type checker and the full test suite. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OPENBLAS_NUM_THREADS=1
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# Types over services/ (every stage and services/common) and gateway/, strict on gateway/ and services/common/
# ([tool.mypy] and its overrides in pyproject.toml).
.venv/bin/mypy
set +e
.venv/bin/python -m pytest -q -rs "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests" >&2
  exit 1
fi
exit "$rc"
