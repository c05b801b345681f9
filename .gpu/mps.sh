#!/usr/bin/env bash
# Realtime at 16 sessions without and with CUDA MPS (the three stage processes share the GPU through one
# MPS server instead of time-slicing it), then the chat e2e with per-burst stage marks. Repo root.
set -uo pipefail
source .gpu/env.sh || exit 1
t0=$(date +%s)
make_checkpoint || exit 1
echo "checkpoint ready after $(( $(date +%s) - t0 )) s"
ARMS=on ON_LEVELS=${LEVELS:-16} TAG=_plain bash .gpu/rt.sh
if command -v nvidia-cuda-mps-control >/dev/null; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
  nvidia-cuda-mps-control -d && echo "mps daemon started"
  ARMS=on ON_LEVELS=${LEVELS:-16} TAG=_mps bash .gpu/rt.sh
  echo quit | nvidia-cuda-mps-control; sleep 2
  tail -5 $CUDA_MPS_LOG_DIRECTORY/control.log 2>/dev/null; tail -5 $CUDA_MPS_LOG_DIRECTORY/server.log 2>/dev/null
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
else
  echo "no nvidia-cuda-mps-control on this host"
fi
echo "elapsed $(( $(date +%s) - t0 )) s"
if [ "${E2E:-1}" = 1 ]; then
  run_e2e 200 8,1 4 120 --timeline-first
  echo "e2e rc=$? elapsed $(( $(date +%s) - t0 )) s"
  mkdir -p $OUT/e2e; cp /tmp/e2e/*.json /tmp/e2e/*.md $OUT/e2e/ 2>/dev/null; tail -40 /tmp/e2e.log
fi
