"""Daily-Omni accuracy through ``/v1/chat/completions``: multiple-choice questions on video + audio.

    python -m examples.online_serving.minicpmo.daily_omni --api-base http://127.0.0.1:8000/v1 \\
        --dataset-root /data/Daily-Omni --results results/daily_omni.jsonl \\
        [--pack video+audio|interleave] [--concurrency 8] [--limit 100] [--enable-thinking]

Dataset: a local copy in the published layout, ``ROOT/qa.json`` (a list of rows with ``Question``,
``Choice`` (the options, ``"A. …"``), ``Answer`` (the letter), ``video_id``, ``Type``, ``video_duration``
(``"30s"`` / ``"60s"``), ``video_category``) and ``ROOT/Videos/<video_id>/<video_id>_video.mp4`` +
``<video_id>_audio.wav`` (``Videos.tar`` extracted). Nothing is fetched from a hub.

Each question is one request with ``modalities: ["text"]`` and ``chat_template_kwargs.enable_thinking``
false unless ``--enable-thinking``: with thinking on, the reasoning can use up the 256-token answer
budget before any letter is written. Requesting audio output changes the chat template, so the numbers
would not be comparable. Two ways to pack the media (``--pack``):

* ``video+audio``: one ``video_url`` (the mp4 with its own audio stream dropped, so the sound is not
  given twice) and one ``input_audio`` (the WAV);
* ``interleave``: for each second t, the frame at t (``image_url``) then second t of the WAV
  (``input_audio``), at most ``--max-frames`` pairs (MiniCPM-o's own streaming layout).

Scoring takes the first stand-alone A–D letter of the answer. Accuracy is reported over answered
questions and over all questions (failures count as wrong), overall, per duration bucket, per
``video_category`` and per ``Type``. Failures (HTTP errors, timeouts, missing media) are counted apart
from wrong answers. Every outcome is appended to ``--results`` (JSON lines) as it arrives; a rerun skips
the questions already answered there and retries the failed ones, so an interrupted run resumes.
``--summary`` (default: beside the results) receives the report as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import re
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

if not __package__:  # run by path (python examples/...py): the repository root goes first on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from examples.online_serving.minicpmo.eval_media import (  # noqa: E402
    AUDIO_RATE,
    data_url,
    frames_at,
    load_audio_16k,
    one_second_wavs,
    video_without_audio,
)
from services.common.audio import wav_bytes  # noqa: E402

PACK_MODES = ("video+audio", "interleave")
_LETTER = re.compile(r"(?<![A-Za-z])([A-D])(?![A-Za-z])")


@dataclass(frozen=True)
class Question:
    qid: str  # stable across runs: row index + video id + a hash of the question
    video_id: str
    question: str
    choices: list[str]
    answer: str
    duration: str
    category: str
    task_type: str


def load_questions(root: Path) -> list[Question]:
    """The rows of ``root/qa.json``; raises ``ValueError`` naming the first malformed row."""
    path = root / "qa.json"
    if not path.is_file():
        raise ValueError(f"{path} not found (expected the Daily-Omni layout: qa.json + Videos/)")
    rows = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(rows, list):
        raise ValueError(f"{path}: expected a JSON list of questions")
    out = []
    for i, row in enumerate(rows):
        try:
            choices = row["Choice"]
            if isinstance(choices, str):
                choices = [c for c in choices.splitlines() if c.strip()]
            question = str(row["Question"]).strip()
            digest = hashlib.sha1(question.encode()).hexdigest()[:8]
            out.append(
                Question(
                    qid=f"{i:05d}-{row['video_id']}-{digest}",
                    video_id=str(row["video_id"]),
                    question=question,
                    choices=[str(c).strip() for c in choices],
                    answer=str(row["Answer"]).strip().upper()[:1],
                    duration=str(row.get("video_duration") or "unknown"),
                    category=str(row.get("video_category") or "unknown"),
                    task_type=str(row.get("Type") or "unknown"),
                )
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"{path}: row {i} is missing or mistypes {exc}") from None
    return out


def first_choice_letter(text: str | None) -> str | None:
    """The first A–D that stands alone (not inside a Latin word): ``"B. a dog"`` → B, ``"Answer: (C)"`` →
    C, ``"答案是D"`` → D. An article ("A man …") counts too: that is the official first-letter rule."""
    match = _LETTER.search(text or "")
    return match.group(1) if match else None


def prompt_text(q: Question) -> str:
    options = "\n".join(q.choices)
    return (
        f"{q.question}\n{options}\n"
        "Answer with the letter of the correct option (A, B, C or D) and nothing else."
    )


def media_parts(q: Question, root: Path, pack: str, max_frames: int) -> list[dict[str, Any]]:
    """The content parts carrying the video and its sound for ``pack``; ``FileNotFoundError`` if absent."""
    folder = root / "Videos" / q.video_id
    video = (folder / f"{q.video_id}_video.mp4").read_bytes()
    audio = load_audio_16k(folder / f"{q.video_id}_audio.wav")
    if pack == "video+audio":
        whole = wav_bytes(audio, AUDIO_RATE)
        return [
            {"type": "video_url", "video_url": {"url": data_url(video_without_audio(video), "video/mp4")}},
            {"type": "input_audio", "input_audio": {"data": data_url(whole, "audio/wav"), "format": "wav"}},
        ]
    frames = frames_at(video, fps=1.0, max_frames=max_frames)
    seconds = one_second_wavs(audio, len(frames))
    parts: list[dict[str, Any]] = []
    for jpeg, wav in zip(frames, seconds, strict=True):
        parts.append({"type": "image_url", "image_url": {"url": data_url(jpeg, "image/jpeg")}})
        parts.append(
            {"type": "input_audio", "input_audio": {"data": data_url(wav, "audio/wav"), "format": "wav"}}
        )
    return parts


# ------------------------------------------------------------------------------------------- running


@dataclass
class Outcome:
    qid: str
    status: str  # "answered" | "failed"
    correct: bool
    predicted: str | None
    answer: str
    duration: str
    category: str
    task_type: str
    reply: str | None = None
    error: str | None = None
    latency_s: float | None = None
    prompt_tokens: int | None = None  # the server's count: shows how much of the media reached the model


def request_body(q: Question, parts: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": args.model,
        "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": prompt_text(q)}]}],
        "modalities": ["text"],
        "max_tokens": args.max_tokens,
        "chat_template_kwargs": {"enable_thinking": bool(args.enable_thinking)},
    }
    if args.temperature is not None:
        body["temperature"] = args.temperature
    return body


async def ask(client: httpx.AsyncClient, q: Question, args: argparse.Namespace) -> Outcome:
    """One question; every failure (missing media, HTTP status, timeout, bad JSON) becomes a failed outcome."""
    base = {
        "qid": q.qid,
        "answer": q.answer,
        "duration": q.duration,
        "category": q.category,
        "task_type": q.task_type,
    }
    t0 = time.monotonic()
    try:
        parts = await asyncio.to_thread(media_parts, q, args.dataset_root, args.pack, args.max_frames)
        resp = await client.post(f"{args.api_base}/chat/completions", json=request_body(q, parts, args))
        if resp.status_code != 200:
            return Outcome(
                status="failed",
                correct=False,
                predicted=None,
                error=f"HTTP {resp.status_code}: {resp.text[:300]}",
                **base,
            )
        payload = resp.json()
        reply = payload["choices"][0]["message"].get("content") or ""
        prompt_tokens = (payload.get("usage") or {}).get("prompt_tokens")
    except (OSError, ValueError, KeyError, IndexError, httpx.HTTPError) as exc:
        return Outcome(
            status="failed", correct=False, predicted=None, error=f"{type(exc).__name__}: {exc}"[:300], **base
        )
    predicted = first_choice_letter(reply)
    return Outcome(
        status="answered",
        correct=predicted == q.answer,
        predicted=predicted,
        reply=reply,
        latency_s=round(time.monotonic() - t0, 3),
        prompt_tokens=prompt_tokens,
        **base,
    )


def read_results(path: Path) -> dict[str, Outcome]:
    """The latest outcome per question from a results file (a torn last line is ignored)."""
    done: dict[str, Outcome] = {}
    if not path.is_file():
        return done
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out = Outcome(**json.loads(line))
        except (ValueError, TypeError):
            continue
        done[out.qid] = out
    return done


async def run(questions: list[Question], args: argparse.Namespace) -> dict[str, Outcome]:
    previous = read_results(args.results)
    todo = [q for q in questions if previous.get(q.qid) is None or previous[q.qid].status != "answered"]
    outcomes = {q.qid: previous[q.qid] for q in questions if q.qid in previous}
    args.results.parent.mkdir(parents=True, exist_ok=True)
    sem = asyncio.Semaphore(args.concurrency)
    timeout = httpx.Timeout(args.timeout, connect=30.0)
    with (
        args.results.open("a", encoding="utf-8") as sink,
        tqdm(
            total=len(questions),
            initial=len(questions) - len(todo),
            desc="daily-omni",
            unit="q",
            file=sys.stderr,
        ) as bar,
    ):
        async with httpx.AsyncClient(timeout=timeout) as client:

            async def one(q: Question) -> None:
                async with sem:
                    out = await ask(client, q, args)
                outcomes[q.qid] = out
                sink.write(json.dumps(asdict(out), ensure_ascii=False) + "\n")
                sink.flush()
                bar.update(1)

            await asyncio.gather(*(one(q) for q in todo))
    return outcomes


def _bucket(outs: list[Outcome]) -> dict[str, Any]:
    answered = [o for o in outs if o.status == "answered"]
    correct = sum(o.correct for o in answered)
    return {
        "questions": len(outs),
        "answered": len(answered),
        "failed": len(outs) - len(answered),
        "correct": correct,
        "wrong": len(answered) - correct,
        "no_letter": sum(o.predicted is None for o in answered),
        "accuracy": correct / len(answered) if answered else None,
        "accuracy_incl_failures": correct / len(outs) if outs else None,
    }


def summarize(outcomes: list[Outcome]) -> dict[str, Any]:
    """Overall, per duration bucket, per video category and per question type."""
    report: dict[str, Any] = {"overall": _bucket(outcomes)}
    for key, field in (("by_duration", "duration"), ("by_category", "category"), ("by_type", "task_type")):
        groups: dict[str, list[Outcome]] = defaultdict(list)
        for o in outcomes:
            groups[getattr(o, field)].append(o)
        report[key] = {name: _bucket(group) for name, group in sorted(groups.items())}
    report["failures"] = [{"qid": o.qid, "error": o.error} for o in outcomes if o.status == "failed"][:50]
    return report


def _print_report(report: dict[str, Any]) -> None:
    def fmt(b: dict[str, Any]) -> str:
        acc = "-" if b["accuracy"] is None else f"{100 * b['accuracy']:.2f}%"
        return (
            f"{acc} ({b['correct']}/{b['answered']} answered; {b['failed']} failed, "
            f"{100 * (b['accuracy_incl_failures'] or 0):.2f}% incl. failures)"
        )

    print(f"overall: {fmt(report['overall'])}")
    for key in ("by_duration", "by_category", "by_type"):
        for name, b in report[key].items():
            print(f"  {key[3:]} {name}: {fmt(b)}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description="Daily-Omni multiple-choice accuracy through /v1/chat/completions"
    )
    ap.add_argument("--api-base", default="http://127.0.0.1:8000/v1", help="the server's /v1 URL")
    ap.add_argument("--model", default="openbmb/MiniCPM-o-4_5")
    ap.add_argument("--dataset-root", type=Path, required=True, help="folder with qa.json and Videos/")
    ap.add_argument("--pack", choices=PACK_MODES, default="video+audio")
    ap.add_argument("--max-frames", type=int, default=64, help="interleave: at most this many 1 s pairs")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--limit", type=int, default=None, help="only the first N questions")
    ap.add_argument(
        "--results", type=Path, default=Path("daily_omni_results.jsonl"), help="JSON lines; resumable"
    )
    ap.add_argument("--summary", type=Path, default=None, help="report JSON (default: RESULTS.summary.json)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=None)
    ap.add_argument(
        "--enable-thinking", action="store_true", help="let the model reason first (off by default)"
    )
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    args = ap.parse_args(argv)
    if args.concurrency < 1 or args.max_frames < 1 or (args.limit is not None and args.limit < 1):
        ap.error("--concurrency, --max-frames and --limit must be positive")
    args.api_base = args.api_base.rstrip("/")
    if args.summary is None:
        args.summary = args.results.with_suffix(".summary.json")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        questions = load_questions(args.dataset_root)
    except ValueError as exc:
        print(f"daily_omni: {exc}", file=sys.stderr)
        return 2
    if args.limit is not None:
        questions = questions[: args.limit]
    outcomes = asyncio.run(run(questions, args))
    report = summarize([outcomes[q.qid] for q in questions])
    report["config"] = {
        "pack": args.pack,
        "enable_thinking": args.enable_thinking,
        "max_tokens": args.max_tokens,
        "model": args.model,
        "questions": len(questions),
    }
    args.summary.parent.mkdir(parents=True, exist_ok=True)
    args.summary.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    _print_report(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
