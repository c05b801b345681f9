#!/usr/bin/env bash
# Create .venv with everything the project, its tests and its demo need, pinned by constraints/cpu.txt.
# Idempotent: a second run only re-checks. Works on a fresh CPU machine with Python 3.11 and PyPI access.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.minicpmo-installed
want=$(cat pyproject.toml constraints/cpu.txt | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[setup] installing dependencies into .venv (first run takes ~2 minutes)"
  .venv/bin/pip install -q --disable-pip-version-check -c constraints/cpu.txt -e ".[dev,frameworks]"
  # instructor and openai-agents without their dependencies (pyproject.toml, the `frameworks` extra, says why)
  no_deps=$(.venv/bin/python -c 'import tomllib; print(" ".join(tomllib.load(open("pyproject.toml", "rb"))["tool"]["minicpmo"]["frameworks-no-deps"]))')
  # shellcheck disable=SC2086
  .venv/bin/pip install -q --disable-pip-version-check --no-deps -c constraints/cpu.txt $no_deps
  echo "$want" > "$stamp"
fi
# torchaudio's wheel ships CUDA-built native libraries that fail to load beside CPU torch; the project
# only uses its pure-Python parts (kaldi fbank, resample, MelSpectrogram), so drop the .so files.
ta_lib=$(.venv/bin/python - <<'PY'
import importlib.util, pathlib
spec = importlib.util.find_spec("torchaudio")
print(pathlib.Path(spec.origin).parent / "lib" if spec else "")
PY
)
if [ -n "$ta_lib" ] && ls "$ta_lib"/*.so >/dev/null 2>&1; then
  rm -f "$ta_lib"/*.so
fi
# Some tests use Debian packages: the realtime web page's browser test (tests/test_realtime_web_browser.py)
# drives Debian's chromium through Playwright (no browser download), the compose cross-check
# (tests/test_deploy_compose.py) runs docker-compose's own `config` merge (no daemon needed), and the
# Silero VAD tests (tests/test_realtime_silero_vad.py) speak their sentences with espeak-ng, and the Gradio
# demo streams speech to its page through ffmpeg (without it the demo plays each reply once complete).
# Install them where apt-get can (as root); elsewhere those tests skip and say why.
apt_wanted=()
command -v chromium >/dev/null 2>&1 || apt_wanted+=(chromium)
command -v docker-compose >/dev/null 2>&1 || apt_wanted+=(docker-compose)
command -v espeak-ng >/dev/null 2>&1 || apt_wanted+=(espeak-ng)
command -v ffmpeg >/dev/null 2>&1 || apt_wanted+=(ffmpeg)
if [ "${#apt_wanted[@]}" -gt 0 ] && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  echo "[setup] installing ${apt_wanted[*]} with apt-get (for the browser, compose, VAD and demo tests)"
  if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${apt_wanted[@]}"; } \
      >/tmp/minicpmo-apt-install.log 2>&1; then
    echo "[setup] warning: apt-get install failed (see /tmp/minicpmo-apt-install.log); those tests will skip" >&2
  fi
fi
.venv/bin/python -c "import torch, torchaudio, grpc, stepaudio2" 2>/dev/null || {
  echo "[setup] import check failed" >&2; exit 1; }
echo "[setup] .venv ready"
