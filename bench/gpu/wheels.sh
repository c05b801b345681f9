#!/usr/bin/env bash
# Run on a machine WITH network access, from the repository root: download the Python 3.12 manylinux
# wheels of the packages the GPU host lacks into .whl/ (or OUT_DIR), at the versions constraints/cpu.txt
# pins, so that bench/gpu/env.sh can install them there offline with --no-deps.
#   bash bench/gpu/wheels.sh [OUT_DIR] [extra requirement ...]          (about 25 MiB)
# The GPU host (see bench/README.md) already has torch, torchaudio, transformers, grpcio, protobuf, numpy,
# scipy, onnxruntime, safetensors, prometheus-client and pytest; these are the rest of what the stages,
# the gateway and the benches import (llguidance for constrained decoding; xgrammar only for
# bench.thinker.grammar_engines; httpx and its dependencies for the bench clients). --no-deps everywhere keeps pip from replacing the host's torch.
set -euo pipefail
out=${1:-.whl}; shift || true
mkdir -p "$out"
names=(
  stepaudio2-minicpmo s3tokenizer HyperPyYAML ruamel.yaml ruamel.yaml.clib diffusers importlib_metadata zipp
  librosa audioread soxr pooch decorator lazy-loader soundfile cffi pycparser platformdirs silero-vad av
  fastapi starlette pydantic pydantic_core typing-inspection annotated-types opentelemetry-api
  uvicorn websockets grpcio-tools grpcio-health-checking grpcio-reflection python-multipart
  llguidance xgrammar apache-tvm-ffi httpx httpcore anyio sniffio h11 certifi idna
)
reqs=()
for n in "${names[@]}"; do
  pin=$(grep -i "^${n}==" constraints/cpu.txt | head -1 || true)
  reqs+=("${pin:-$n}")
done
reqs+=("$@")
for r in "${reqs[@]}"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$out" "$r" || echo "could not download $r" >&2
done
du -sh "$out"
