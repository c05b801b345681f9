# Sourced by the .gpu/*.sh scripts on the GPU host (run from the repo root): install the carried wheels
# (.whl/, see ../shared/tools/gpu-host-wheels.sh) into /tmp/site, point PYTHONPATH at them and the repo,
# and make $OUT. Returns non-zero if the wheels do not install.
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >/dev/null 2>&1 || { echo "wheel install failed"; return 1; }
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
OUT=${OUT:-bench-results}
mkdir -p "$OUT"
