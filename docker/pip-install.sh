#!/bin/sh
# Build /opt/venv inside an image build.   usage: pip-install.sh deps|deps-gateway|project|project-gateway
#   deps:            the project's runtime dependencies from pyproject.toml, pinned by constraints/cpu.txt
#   deps-gateway:    only what the gateway imports ([tool.minicpmo] gateway-dependencies): no torch
#   project:         the project itself (no dependencies, no build isolation: nothing more is fetched)
#   project-gateway: the same, then a check that the gateway starts without torch
# PIP_OFFLINE=1 installs from docker/wheelhouse only; TORCH_INDEX_URL adds the index serving the torch
# build for this variant (the CPU wheel index for CPU images; empty for CUDA: PyPI's default build).
set -eu
mode=$1
cd /src
[ -x /opt/venv/bin/python ] || python3 -m venv /opt/venv
if [ "${PIP_OFFLINE:-0}" = 1 ]; then
  set -- --no-index --find-links docker/wheelhouse
elif [ -n "${TORCH_INDEX_URL:-}" ]; then
  set -- --extra-index-url "$TORCH_INDEX_URL"
else
  set --
fi
pip() { /opt/venv/bin/python -m pip --disable-pip-version-check --no-cache-dir "$@"; }
case "$mode" in
  deps)
    /opt/venv/bin/python - > /tmp/requirements.txt <<'PY'
import tomllib
with open("pyproject.toml", "rb") as fh:
    print("\n".join(tomllib.load(fh)["project"]["dependencies"]))
PY
    pip install "$@" -c constraints/cpu.txt -r /tmp/requirements.txt "setuptools>=68" wheel
    # torchaudio's native libraries target a different torch build; the project uses only its
    # pure-Python parts (as scripts/setup.sh does on the host).
    rm -f /opt/venv/lib/python3*/site-packages/torchaudio/lib/*.so
    ;;
  deps-gateway)
    /opt/venv/bin/python - > /tmp/requirements.txt <<'PY'
import tomllib
with open("pyproject.toml", "rb") as fh:
    print("\n".join(tomllib.load(fh)["tool"]["minicpmo"]["gateway-dependencies"]))
PY
    /opt/venv/bin/python - > /tmp/no-deps.txt <<'PY'
import tomllib
with open("pyproject.toml", "rb") as fh:
    print("\n".join(tomllib.load(fh)["tool"]["minicpmo"]["gateway-no-deps"]))
PY
    pip install "$@" -c constraints/cpu.txt -r /tmp/requirements.txt "setuptools>=68" wheel
    pip install "$@" --no-deps -c constraints/cpu.txt -r /tmp/no-deps.txt
    ;;
  project)
    pip install "$@" --no-deps --no-build-isolation .
    /opt/venv/bin/python -c "import services.common.deploy_profile, grpc_health.v1.health"
    ;;
  project-gateway)
    pip install "$@" --no-deps --no-build-isolation .
    /opt/venv/bin/python -c "import sys, gateway.app, gateway.launcher; assert 'torch' not in sys.modules"
    ;;
  *)
    echo "usage: $0 deps|deps-gateway|project|project-gateway" >&2
    exit 2
    ;;
esac
