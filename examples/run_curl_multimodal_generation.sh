#!/usr/bin/env bash
# Chat with MiniCPM-o 4.5 using plain curl: text, image or audio in; text and/or speech out.
#
#   bash examples/run_curl_multimodal_generation.sh [text|use_image|use_audio] [text|text,audio]
#
# Environment: HOST (127.0.0.1), PORT (8099), OUT (reply WAV, default curl_reply.wav), API_KEY (optional),
# PROMPT (overrides the question). Sample media are synthesised with the project's Python (PYTHON,
# default .venv/bin/python or python3), so nothing needs downloading. Needs curl; the reply's speech is
# decoded from base64 with the same Python.
set -euo pipefail
QUERY_TYPE=${1:-text}
MODALITIES=${2:-text,audio}
HOST=${HOST:-127.0.0.1}
PORT=${PORT:-8099}
OUT=${OUT:-curl_reply.wav}
here=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-$( [ -x "$here/.venv/bin/python" ] && echo "$here/.venv/bin/python" || echo python3 )}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

case "$QUERY_TYPE" in
  text) default_prompt="Say hello and introduce yourself in one sentence." ;;
  use_image) default_prompt="What is in this image?" ;;
  use_audio) default_prompt="What do you hear in this audio?" ;;
  *) echo "usage: $0 [text|use_image|use_audio] [text|text,audio]" >&2; exit 2 ;;
esac
PROMPT=${PROMPT:-$default_prompt}

# Build the JSON body (media as data: URLs) with Python: robust quoting, no jq needed.
"$PYTHON" - "$QUERY_TYPE" "$MODALITIES" "$PROMPT" > "$tmp/body.json" <<'PY'
import base64, io, json, sys
import numpy as np
query, modalities, prompt = sys.argv[1], [m for m in sys.argv[2].split(",") if m], sys.argv[3]
parts = []
if query == "use_image":
    from PIL import Image
    y, x = np.mgrid[0:224, 0:224]
    buf = io.BytesIO()
    Image.fromarray(np.stack([x, y, np.full_like(x, 160)], -1).astype(np.uint8)).save(buf, format="PNG")
    parts.append({"type": "image_url",
                  "image_url": {"url": "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()}})
elif query == "use_audio":
    import soundfile as sf
    t = np.arange(24000) / 16000
    buf = io.BytesIO()
    sf.write(buf, (0.3 * np.sin(2 * np.pi * 300 * t)).astype(np.float32), 16000, format="WAV", subtype="PCM_16")
    parts.append({"type": "audio_url",
                  "audio_url": {"url": "data:audio/wav;base64," + base64.b64encode(buf.getvalue()).decode()}})
parts.append({"type": "text", "text": prompt})
want_audio = "audio" in modalities
body = {
    "model": "openbmb/MiniCPM-o-4_5",
    "messages": [{"role": "user", "content": parts}],
    "modalities": modalities,
    "chat_template_kwargs": {"use_tts_template": want_audio, "enable_thinking": False},
}
if want_audio:
    body["audio"] = {"format": "wav"}
json.dump(body, sys.stdout)
PY

auth=()
if [ -n "${API_KEY:-}" ]; then auth=(-H "Authorization: Bearer $API_KEY"); fi
status=$(curl -sS -o "$tmp/reply.json" -w '%{http_code}' "${auth[@]}" \
  -H 'Content-Type: application/json' --data-binary @"$tmp/body.json" \
  "http://$HOST:$PORT/v1/chat/completions")
if [ "$status" != "200" ]; then
  echo "HTTP $status: $(cat "$tmp/reply.json")" >&2
  exit 1
fi
"$PYTHON" - "$tmp/reply.json" "$OUT" <<'PY'
import base64, json, sys
reply = json.load(open(sys.argv[1]))
choice = reply["choices"][0]
print("text:", choice["message"].get("content"))
print("finish_reason:", choice["finish_reason"], "usage:", reply["usage"])
audio = choice["message"].get("audio")
if audio:
    with open(sys.argv[2], "wb") as f:
        f.write(base64.b64decode(audio["data"]))
    meta = choice["audio_metadata"]
    print(f"audio: {meta['frame_count'] / meta['sample_rate_hz']:.2f} s at {meta['sample_rate_hz']} Hz -> {sys.argv[2]}")
PY
