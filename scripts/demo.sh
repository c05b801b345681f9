#!/usr/bin/env bash
# The whole pipeline in one command, on the CPU, with a tiny random-weight checkpoint:
#   1. install into .venv (scripts/setup.sh),
#   2. start minicpmo-serve (thinker, talker, code2wav and the gateway as child processes; the tiny
#      checkpoint is generated once and cached under ~/.cache/minicpmo),
#   3. send one chat request with an audio question through the OpenAI SDK example client, asking for
#      text and speech, and save the spoken reply as out/demo_reply.wav,
#   4. print a summary and stop every process.
# Bounded in time (DEMO_TIMEOUT seconds for start-up, default 600); exits non-zero on any failure.
# Random weights speak noise and write gibberish: the demo shows the plumbing, not the model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-1}
PY=.venv/bin/python
START_TIMEOUT=${DEMO_TIMEOUT:-600}
PORT=${DEMO_PORT:-$($PY -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
mkdir -p out
run_dir=$(mktemp -d -t minicpmo-demo.XXXXXX)
serve_log="$run_dir/serve.log"

echo "[demo] starting minicpmo-serve on port $PORT (logs: $run_dir)"
$PY -m gateway.launcher --deploy-config cpu --device cpu --stage-ports auto --port "$PORT" \
  --log-dir "$run_dir/logs" --startup-timeout "$START_TIMEOUT" >"$serve_log" 2>&1 &
serve_pid=$!

stop_serve() {
  if kill -0 "$serve_pid" 2>/dev/null; then
    echo "[demo] stopping minicpmo-serve"
    kill -TERM "$serve_pid" 2>/dev/null || true
    for _ in $(seq 1 60); do kill -0 "$serve_pid" 2>/dev/null || break; sleep 0.5; done
    kill -KILL "$serve_pid" 2>/dev/null || true
  fi
}
trap stop_serve EXIT

deadline=$((SECONDS + START_TIMEOUT + 60))
until grep -q "\[minicpmo-serve\] ready" "$serve_log"; do
  if ! kill -0 "$serve_pid" 2>/dev/null; then
    echo "[demo] minicpmo-serve exited during start-up:" >&2; cat "$serve_log" >&2; exit 1
  fi
  if [ "$SECONDS" -ge "$deadline" ]; then
    echo "[demo] minicpmo-serve not ready after ${START_TIMEOUT}s:" >&2; cat "$serve_log" >&2; exit 1
  fi
  sleep 1
done
grep "\[minicpmo-serve\]" "$serve_log"

echo "[demo] asking a question with audio input, text + speech output"
t0=$SECONDS
timeout 300 $PY examples/openai_chat_completion_client_for_multimodal_generation.py \
  --port "$PORT" --query-type use_audio --modalities text,audio --stream --output out/demo_reply.wav
$PY - <<'PY'
import soundfile as sf
info = sf.info("out/demo_reply.wav")
assert info.samplerate == 24000 and info.channels == 1 and info.frames > 0, info
print(f"[demo] summary: reply speech out/demo_reply.wav = {info.frames / info.samplerate:.2f} s, "
      f"{info.samplerate} Hz, {info.channels} channel, {info.subtype}")
PY
echo "[demo] round trip took $((SECONDS - t0)) s; metrics: http://127.0.0.1:$PORT/metrics (while running)"
echo "[demo] OK"
