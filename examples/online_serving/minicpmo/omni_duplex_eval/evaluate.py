"""``evaluate`` and ``summarize``: score generated sessions with an OpenAI-compatible multimodal judge.

RTD samples get two kinds of judgement:

* **temporal**, per sentence: the window ``[start - 2 s, end - 2 s]`` (at least 0.5 s long, inside the
  video; a sentence without such a window scores 0 and is counted as an error) is shown to the judge as
  frames at ``--judge-fps``, with the sentence: is it about what is on screen then (``is_relevant``
  0/1), and how timely and accurate is it (``temporal_score`` 0–3)? The 2 s shift allows for the time a
  speaker needs to react;
* **content**, once: all the text against the two reference answers, with the whole video
  (``--judge-video-mode video_url``: the mp4 as a data URL; ``frame-sample``: one frame every 3 s, at
  most 16) → ``content_score`` 0.00–3.00.

PR samples: ``correction`` judges all the text once; reminder splits judge, for each reminder time t,
the sentences that start within ``[t, t + --window-size]`` (none: a miss, no judge call) →
``success_score`` 0/1; a sample succeeds only if every reminder does.

The prompts are this project's own wording on the official score scales, so scores are comparable run
to run here, not with numbers produced by the official prompts. A judge reply without a parsable JSON
object scores 0 and is marked ``judge_unparsed``. Responses recorded with ``clock: invalid`` are
refused unless ``--allow-invalid-clock``.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from examples.online_serving.minicpmo.eval_media import data_url, frames_at
from examples.online_serving.minicpmo.omni_duplex_eval.dataset import Sample
from examples.online_serving.minicpmo.omni_duplex_eval.generate import output_paths

JUDGE_VIDEO_MODES = ("video_url", "frame-sample")
_JSON_OBJECT = re.compile(r"\{[^{}]*\}", re.S)


class InvalidClock(ValueError):
    """The response was generated without real-time pacing."""


def parse_judgement(text: str, keys: dict[str, type]) -> dict[str, Any]:
    """The first JSON object in ``text`` holding the wanted keys, coerced to their types (missing ones 0)."""
    for match in _JSON_OBJECT.findall(text or ""):
        try:
            value = json.loads(match)
        except ValueError:
            continue
        if isinstance(value, dict) and any(k in value for k in keys):
            out: dict[str, Any] = {}
            for key, kind in keys.items():
                try:
                    out[key] = kind(value.get(key, 0))
                except (TypeError, ValueError):
                    out[key] = kind(0)
            if "reason" in value:
                out["reason"] = str(value["reason"])[:500]
            return out
    return {**{k: kind(0) for k, kind in keys.items()}, "judge_unparsed": True}


def temporal_prompt(lo: float, hi: float, sentence: str, question: str) -> str:
    return (
        f"The frames show a video from {lo:.1f} s to {hi:.1f} s. While watching it live, an assistant said: "
        f'"{sentence}". The user had asked: "{question}".\n'
        "Is the sentence about what these frames show (is_relevant 1 or 0)? If it is, rate how accurate and "
        "timely it is for this moment: 3 exactly right and on time, 2 mostly right, 1 vague or late, 0 wrong.\n"
        'Reply with JSON only: {"is_relevant": 0 or 1, "temporal_score": 0-3, "reason": "..."}'
    )


def content_prompt(text: str, question: str, answers: tuple[str, ...]) -> str:
    refs = "\n".join(f"- {a}" for a in answers) or "- (none given)"
    return (
        f'The user asked about this video: "{question}". Reference answers:\n{refs}\n'
        f'The assistant said, while the video played: "{text}".\n'
        "Rate how well what the assistant said matches the video and the references, from 0.00 (wrong or "
        "nothing) to 3.00 (complete and correct).\n"
        'Reply with JSON only: {"content_score": 0.00-3.00, "reason": "..."}'
    )


def reminder_prompt(task: str, question: str, said: str, expected: str) -> str:
    goal = (
        "correct the user's mistaken statement"
        if task == "correction"
        else "remind the user at the right moment"
    )
    return (
        f'In a live video conversation the assistant had to {goal}. The user said: "{question}". '
        f'The expected behaviour: "{expected}". What the assistant said in the window judged: "{said}".\n'
        "Did the assistant do it (success_score 1) or not (0)?\n"
        'Reply with JSON only: {"success_score": 0 or 1, "reason": "..."}'
    )


class Judge:
    """An OpenAI-compatible ``/chat/completions`` endpoint used as the judge (temperature 0.1, text out)."""

    def __init__(self, base_url: str, model: str, client: httpx.AsyncClient, max_tokens: int = 512) -> None:
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model, self.client, self.max_tokens = model, client, max_tokens

    async def ask(self, prompt: str, images: Sequence[bytes] = (), video: bytes | None = None) -> str:
        content: list[dict[str, Any]] = []
        if video is not None:
            content.append({"type": "video_url", "video_url": {"url": data_url(video, "video/mp4")}})
        content += [{"type": "image_url", "image_url": {"url": data_url(j, "image/jpeg")}} for j in images]
        content.append({"type": "text", "text": prompt})
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": content}],
            "temperature": 0.1,
            "max_tokens": self.max_tokens,
            "modalities": ["text"],
        }
        resp = await self.client.post(self.url, json=body)
        if resp.status_code != 200:
            raise httpx.HTTPStatusError(
                f"judge answered {resp.status_code}: {resp.text[:300]}", request=resp.request, response=resp
            )
        return str(resp.json()["choices"][0]["message"].get("content") or "")


def temporal_window(start: float, end: float, duration: float) -> tuple[float, float] | None:
    lo = max(0.0, start - 2.0)
    hi = max(lo + 0.5, end - 2.0)
    return (lo, hi) if hi <= duration else None


async def _rtd(sample: Sample, items: list[dict[str, Any]], judge: Judge, args: Any) -> dict[str, Any]:
    frames = await asyncio.to_thread(frames_at, sample.video, float(args.judge_fps), 100_000)
    duration = sample.video_duration or len(frames) / args.judge_fps
    rows = []
    for item in items:
        window = temporal_window(item["start"], item["end"], duration)
        if window is None:
            rows.append({**item, "error": "no valid temporal window", "temporal_score": 0, "is_relevant": 0})
            continue
        lo_i, hi_i = (
            int(window[0] * args.judge_fps),
            max(int(window[1] * args.judge_fps), int(window[0] * args.judge_fps) + 1),
        )
        reply = await judge.ask(
            temporal_prompt(*window, item["sentence"], sample.question_text), frames[lo_i:hi_i]
        )
        rows.append(
            {
                **item,
                "window": list(window),
                **parse_judgement(reply, {"is_relevant": int, "temporal_score": int}),
            }
        )
    text = " ".join(i["sentence"] for i in items)
    if args.judge_video_mode == "video_url":
        reply = await judge.ask(
            content_prompt(text, sample.question_text, sample.answers), video=sample.video
        )
    else:
        step = max(1, int(3 * args.judge_fps))
        sampled = frames[::step]
        sampled = (
            [sampled[round(i * (len(sampled) - 1) / 15)] for i in range(16)] if len(sampled) > 16 else sampled
        )
        reply = await judge.ask(content_prompt(text, sample.question_text, sample.answers), sampled)
    relevant = [r for r in rows if not r.get("error") and r.get("is_relevant") == 1]
    return {
        "temporal": {
            "sentences": rows,
            "avg_temporal_score": sum(r["temporal_score"] for r in relevant) / len(relevant)
            if relevant
            else 0.0,
            "relevant": len(relevant),
            "errors": sum(1 for r in rows if r.get("error")),
        },
        "content": parse_judgement(reply, {"content_score": float}),
    }


async def _pr(sample: Sample, items: list[dict[str, Any]], judge: Judge, args: Any) -> dict[str, Any]:
    expected = sample.answers[0] if sample.answers else ""
    events = []
    if sample.task == "correction" or not sample.reminders:
        said = " ".join(i["sentence"] for i in items)
        reply = await judge.ask(reminder_prompt(sample.task, sample.question_text, said, expected))
        events.append({"said": said, **parse_judgement(reply, {"success_score": int})})
    else:
        for t in sample.reminders:
            said = " ".join(i["sentence"] for i in items if t <= i["start"] <= t + args.window_size)
            if not said:
                events.append({"at": t, "said": "", "success_score": 0})
                continue
            reply = await judge.ask(reminder_prompt(sample.task, sample.question_text, said, expected))
            events.append({"at": t, "said": said, **parse_judgement(reply, {"success_score": int})})
    success = bool(events) and all(e["success_score"] == 1 for e in events)
    return {"pr": {"events": events, "success": success}}


async def evaluate_sample(sample: Sample, judge: Judge, args: Any) -> dict[str, Any]:
    out, meta_path = output_paths(args.response_root, sample)
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    if meta.get("clock") != "media" and not args.allow_invalid_clock:
        raise InvalidClock(
            f"{sample.split}/{sample.id}: recorded with clock={meta.get('clock')!r} "
            "(pace as-fast-as-possible); pass --allow-invalid-clock to score it anyway"
        )
    items = json.loads(out.read_text())
    scored = await (_rtd if sample.family == "rtd" else _pr)(sample, items, judge, args)
    return {
        "id": sample.id,
        "split": sample.split,
        "family": sample.family,
        "task": sample.task,
        "clock": meta.get("clock"),
        "judge_model": judge.model,
        "judge_video_mode": args.judge_video_mode,
        **scored,
    }


async def evaluate(samples: list[Sample], args: Any) -> tuple[int, list[str]]:
    """Scores every sample with a response; returns (scored, problems). Invalid clocks are problems."""
    sem = asyncio.Semaphore(args.concurrency)
    problems: list[str] = []
    scored = 0
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout, connect=30.0)) as client:
        judge = Judge(args.judge_base_url, args.judge_model, client, args.judge_max_tokens)

        async def one(sample: Sample) -> None:
            nonlocal scored
            if not output_paths(args.response_root, sample)[0].exists():
                problems.append(f"{sample.split}/{sample.id}: no response (run generate first)")
                return
            async with sem:
                try:
                    result = await evaluate_sample(sample, judge, args)
                except (InvalidClock, httpx.HTTPError, ValueError, KeyError) as exc:
                    problems.append(str(exc))
                    return
            path = args.score_root / sample.split / f"{sample.id}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(result, ensure_ascii=False, indent=2))
            scored += 1

        await asyncio.gather(*(one(s) for s in samples))
    return scored, problems


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarize(score_root: Path) -> dict[str, Any]:
    """Per split and overall: RTD mean content score and mean per-sample temporal score, PR success rate."""
    rows = [json.loads(p.read_text()) for p in sorted(score_root.glob("*/*.json"))]
    splits: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        splits.setdefault(row["split"], []).append(row)

    def block(group: list[dict[str, Any]]) -> dict[str, Any]:
        rtd = [r for r in group if r["family"] == "rtd"]
        pr = [r for r in group if r["family"] == "pr"]
        out: dict[str, Any] = {"samples": len(group)}
        if rtd:
            out["mean_content_score"] = _mean([r["content"]["content_score"] for r in rtd])
            out["mean_temporal_score"] = _mean([r["temporal"]["avg_temporal_score"] for r in rtd])
        if pr:
            out["success_rate"] = _mean([1.0 if r["pr"]["success"] else 0.0 for r in pr])
        return out

    return {"overall": block(rows), "by_split": {name: block(g) for name, g in sorted(splits.items())}}
