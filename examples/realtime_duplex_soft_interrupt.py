"""Soft-interrupt validation driver: run the duplex demo on one WAV and check the model-owned turn taking.

    python examples/realtime_duplex_soft_interrupt.py --url ws://127.0.0.1:8099/v1/realtime \
        --input-wav talk.wav --ref-audio voice.wav --output-dir out/ [--validation-mode model-policy]

The demo (examples/realtime_duplex_demo.py) streams the WAV in real time in 200 ms appends (native lane),
commits, and records ``events.jsonl`` + ``result.json``; this driver then checks them:

* always: the demo succeeded; no ``error``, no ``*.cancelled``/``*.truncated`` event, no cancelled
  ``response.done``; every created response has exactly one ``response.done``; every response has at
  least ``--min-audio-deltas-per-response`` audio deltas, all before its ``response.done``; the first
  ``response.created`` precedes the final ``input_audio_buffer.committed`` (the model answered from the
  stream, not because of the commit);
* ``--validation-mode model-policy`` (default): at least one response;
* ``--validation-mode response-required``: the input's sha256 must equal ``--input-sha256``; at least
  ``--min-responses`` (≥ 2) responses; the second created before the commit; a ``response.listen`` before
  the first response and after the last ``response.done``; a listen between the last pre-commit done and
  the commit, and one after the commit; a non-empty follow-up transcript.
  ``--expect-second-response-substring`` is matched against follow-up transcripts (whitespace removed) and
  reported as ``followup_response_transcript_expectation_ok`` without changing ``ok``.

Writes ``summary.json`` next to the demo's artifacts; exit status 0 iff ``ok``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import wave
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def summarize(
    events: list[dict[str, Any]], result: dict[str, Any], args: argparse.Namespace
) -> dict[str, Any]:
    types = [e["type"] for e in events]
    checks: dict[str, bool] = {}
    created = [i for i, t in enumerate(types) if t == "response.created"]
    rids = [events[i]["response_id"] for i in created]
    done_at: dict[str, list[int]] = {r: [] for r in rids}
    audio_at: dict[str, list[int]] = {r: [] for r in rids}
    for i, e in enumerate(events):
        rid = e.get("response_id")
        if e["type"] == "response.done" and rid in done_at:
            done_at[rid].append(i)
        if e["type"] == "response.output_audio.delta" and rid in audio_at:
            audio_at[rid].append(i)
    commits = [i for i, t in enumerate(types) if t == "input_audio_buffer.committed"]
    final_commit = commits[-1] if commits else len(events)
    listens = [i for i, t in enumerate(types) if t == "response.listen"]

    checks["demo_ok"] = bool(result.get("ok"))
    checks["no_errors"] = "error" not in types
    checks["no_cancelled_or_truncated_events"] = not any(
        t.endswith((".cancelled", ".truncated")) for t in types
    )
    checks["no_cancelled_response_done"] = not any(
        e["type"] == "response.done" and e["response"]["status"] == "cancelled" for e in events
    )
    checks["one_done_per_response"] = all(len(done_at[r]) == 1 for r in rids)
    checks["min_audio_deltas_per_response"] = all(
        len(audio_at[r]) >= args.min_audio_deltas_per_response for r in rids
    )
    checks["no_stale_audio"] = all(
        not done_at[r] or all(i < done_at[r][0] for i in audio_at[r]) for r in rids
    )
    checks["first_response_before_final_commit"] = bool(created) and created[0] < final_commit
    if args.validation_mode == "model-policy":
        checks["at_least_one_response"] = len(rids) >= 1
    else:
        digest = hashlib.sha256(Path(args.input_wav).read_bytes()).hexdigest()
        checks["input_sha256"] = bool(args.input_sha256) and digest == args.input_sha256
        checks["min_responses"] = len(rids) >= max(2, args.min_responses)
        checks["second_response_before_commit"] = len(created) >= 2 and created[1] < final_commit
        checks["listen_before_first_response"] = bool(created) and any(i < created[0] for i in listens)
        last_done = max((d[0] for d in done_at.values() if d), default=-1)
        checks["listen_after_last_done"] = any(i > last_done for i in listens)
        pre_commit_dones = [d[0] for d in done_at.values() if d and d[0] < final_commit]
        last_pre = max(pre_commit_dones, default=-1)
        checks["listen_between_last_done_and_commit"] = any(last_pre < i < final_commit for i in listens)
        checks["listen_after_commit"] = any(i > final_commit for i in listens)
        transcripts = [r["transcript"] for r in result.get("responses", [])]
        checks["followup_transcript_nonempty"] = len(transcripts) >= 2 and any(
            t.strip() for t in transcripts[1:]
        )
    summary: dict[str, Any] = {
        "ok": all(checks.values()),
        "validation_mode": args.validation_mode,
        "checks": checks,
        "responses": len(rids),
        "listens": len(listens),
    }
    if args.expect_second_response_substring:
        needle = "".join(args.expect_second_response_substring.split())
        followups = ["".join(r["transcript"].split()) for r in result.get("responses", [])[1:]]
        summary["followup_response_transcript_expectation_ok"] = any(needle in t for t in followups)
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="ws://127.0.0.1:8099/v1/realtime")
    p.add_argument("--model", default="openbmb/MiniCPM-o-4_5")
    p.add_argument("--input-wav", required=True)
    p.add_argument("--ref-audio", required=True)
    p.add_argument("--output-dir", required=True)
    p.add_argument("--validation-mode", choices=["model-policy", "response-required"], default="model-policy")
    p.add_argument("--input-sha256", default=None)
    p.add_argument("--min-responses", type=int, default=2)
    p.add_argument("--min-audio-deltas-per-response", type=int, default=2)
    p.add_argument(
        "--expect-second-response-substring",
        "--expect-followup-response-substring",
        dest="expect_second_response_substring",
        default=None,
    )
    p.add_argument("--timeout", type=float, default=60.0, help="per-wait timeout passed to the demo")
    args = p.parse_args(argv)
    if args.validation_mode == "response-required" and not args.input_sha256:
        p.error("--validation-mode response-required needs --input-sha256")
    with wave.open(args.input_wav) as w:
        duration = w.getnframes() / w.getframerate()
    out = Path(args.output_dir)
    cmd = [
        sys.executable,
        str(HERE / "realtime_duplex_demo.py"),
        "--url",
        args.url,
        "--model",
        args.model,
        "--input-wav",
        args.input_wav,
        "--ref-audio",
        args.ref_audio,
        "--output-dir",
        str(out),
        "--chunk-ms",
        "200",
        "--timeout",
        str(args.timeout),
    ]
    proc = subprocess.run(cmd, timeout=duration + 2 * args.timeout + 30, capture_output=True, text=True)
    result_path = out / "result.json"
    result = json.loads(result_path.read_text()) if result_path.exists() else {"ok": False}
    events_path = out / "events.jsonl"
    events = (
        [json.loads(line) for line in events_path.read_text().splitlines()] if events_path.exists() else []
    )
    summary = summarize(events, result, args)
    summary["demo_returncode"] = proc.returncode
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
