"""Omni-DuplexEval (examples/online_serving/minicpmo/omni_duplex_eval): sentence timing and judge parsing
on fixed input, then generate → evaluate → summarize end to end on a tiny synthetic dataset in the
published Parquet layout, with the embedded launcher (tiny checkpoint) as both the system under test and
the judge: as fast as possible (clock invalid, refused unless allowed) and once paced in real time."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from launched_pipeline import Served, launched
from media_samples import mp4_bytes, wav_bytes

from examples.online_serving.minicpmo.omni_duplex_eval.__main__ import main
from examples.online_serving.minicpmo.omni_duplex_eval.dataset import load_samples
from examples.online_serving.minicpmo.omni_duplex_eval.evaluate import parse_judgement, temporal_window
from examples.online_serving.minicpmo.omni_duplex_eval.generate import realtime_url, timed_sentences

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def test_timed_sentences_follow_the_media_clock() -> None:
    deltas = [
        ("The cat", 1000),
        (" sits. It", 2000),
        ("", 2500),
        (" jumps!", 3000),
        (" Then", 4000),
        (" rests", 5000),
    ]
    assert timed_sentences(deltas) == [
        {"sentence": "The cat sits.", "start": 1.0, "end": 2.0},
        {"sentence": "It jumps!", "start": 2.0, "end": 3.0},
        {"sentence": "Then rests", "start": 4.0, "end": 5.0},
    ]
    assert timed_sentences([]) == []


def test_judge_replies_and_windows() -> None:
    assert parse_judgement(
        'ok {"is_relevant": 1, "temporal_score": "2", "reason": "fine"} done',
        {"is_relevant": int, "temporal_score": int},
    ) == {"is_relevant": 1, "temporal_score": 2, "reason": "fine"}
    assert parse_judgement("no json here", {"success_score": int}) == {
        "success_score": 0,
        "judge_unparsed": True,
    }
    assert temporal_window(1.0, 1.2, 10.0) == (0.0, 0.5)  # at least 0.5 s long
    assert temporal_window(5.0, 9.0, 10.0) == (3.0, 7.0)  # shifted back 2 s for the reaction time
    assert temporal_window(5.0, 13.0, 10.0) is None  # past the end of the video
    assert realtime_url("http://h:1/v1", "m") == "ws://h:1/v1/realtime?duplex=1&model=m&autostart=0"


def make_dataset(root: Path) -> None:
    """RTD_OCR with one sample (media inline) and PR_event_reminder with one (media by relative path)."""
    (root / "data").mkdir(parents=True)
    (root / "media").mkdir()
    (root / "media" / "q.wav").write_bytes(wav_bytes(2.0, freq=250.0))
    (root / "media" / "v.mp4").write_bytes(mp4_bytes(3.0))
    rtd = {
        "id": "ocr_0",
        "video": {"bytes": mp4_bytes(3.0), "path": None},
        "question_audio": {"bytes": wav_bytes(2.0), "path": None},
        "question_text": "What does the sign say?",
        "answer1": "It says open.",
        "answer2": "Open.",
        "reminder1": None,
        "reminder2": None,
        "video_duration": 3.0,
        "video_type": "ocr",
    }
    pr = {
        "id": "rem_0",
        "video": {"bytes": None, "path": "media/v.mp4"},
        "question_audio": {"bytes": None, "path": "media/q.wav"},
        "question_text": "Tell me when it turns green.",
        "answer1": "It turned green.",
        "answer2": None,
        "reminder1": 1.0,
        "reminder2": None,
        "video_duration": 3.0,
        "video_type": "reminder",
    }
    for split, row in (("RTD_OCR", rtd), ("PR_event_reminder", pr)):
        pq.write_table(pa.Table.from_pylist([row]), root / "data" / f"{split}-00000-of-00001.parquet")


def test_dataset_layout_and_errors(tmp_path: Path) -> None:
    make_dataset(tmp_path)
    samples = load_samples(tmp_path)
    assert [(s.split, s.id, s.family, s.task) for s in samples] == [
        ("PR_event_reminder", "rem_0", "pr", "event_reminder"),
        ("RTD_OCR", "ocr_0", "rtd", "rtd"),
    ]
    assert samples[0].reminders == (1.0,) and samples[1].answers == ("It says open.", "Open.")
    assert samples[0].video[:8] == (tmp_path / "media" / "v.mp4").read_bytes()[:8]
    with pytest.raises(ValueError, match="present"):
        load_samples(tmp_path, "RTD_counting")
    assert (
        main(["generate", "--dataset", str(tmp_path / "nope"), "--response-root", str(tmp_path / "r")]) == 2
    )


@pytest.fixture(scope="module")
def served(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with launched(tiny_ckpt, tmp_path_factory.mktemp("serve")) as s:
        yield s


@pytest.mark.slow
def test_generate_evaluate_summarize(
    served: Served, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data, responses, scores = tmp_path / "ds", tmp_path / "responses", tmp_path / "scores"
    make_dataset(data)
    common = ["--dataset", str(data), "--response-root", str(responses), "--concurrency", "2"]
    assert main(["generate", *common, "--url", served.url, "--pace", "as-fast-as-possible"]) == 0
    for split, sid in (("RTD_OCR", "ocr_0"), ("PR_event_reminder", "rem_0")):
        meta = json.loads((responses / split / f"{sid}.meta.json").read_text())
        assert meta["clock"] == "invalid" and meta["pace"] == "as-fast-as-possible" and meta["units"] == 3, (
            meta
        )
        assert meta["close_timeout"] is None, meta
        sentences = json.loads((responses / split / f"{sid}.json").read_text())
        assert all(0 <= s["start"] <= s["end"] <= 3.0 for s in sentences), sentences
    metrics = json.loads((responses / "duplex_metrics.json").read_text())
    assert sorted(r["id"] for r in metrics["samples"]) == ["ocr_0", "rem_0"]
    assert all(r["errors"] == 0 for r in metrics["samples"]), metrics

    judge = [
        "--score-root",
        str(scores),
        "--judge-base-url",
        f"{served.url}/v1",
        "--judge-model",
        "openbmb/MiniCPM-o-4_5",
        "--judge-max-tokens",
        "16",
    ]
    assert main(["evaluate", *common, *judge]) == 1  # clock=invalid is refused
    assert "allow-invalid-clock" in capsys.readouterr().err and not scores.exists()
    assert (
        main(["evaluate", *common, *judge, "--allow-invalid-clock", "--judge-video-mode", "frame-sample"])
        == 0
    )
    rtd = json.loads((scores / "RTD_OCR" / "ocr_0.json").read_text())
    assert rtd["clock"] == "invalid" and 0.0 <= rtd["content"]["content_score"] <= 3.0
    assert "avg_temporal_score" in rtd["temporal"]
    pr = json.loads((scores / "PR_event_reminder" / "rem_0.json").read_text())
    assert isinstance(pr["pr"]["success"], bool) and pr["pr"]["events"][0]["at"] == 1.0

    assert main(["summarize", "--score-root", str(scores)]) == 0
    summary = json.loads((scores / "summary.json").read_text())
    assert summary["overall"]["samples"] == 2
    assert set(summary["by_split"]) == {"RTD_OCR", "PR_event_reminder"}
    assert (
        "mean_content_score" in summary["by_split"]["RTD_OCR"]
        and "success_rate" in summary["by_split"]["PR_event_reminder"]
    )

    # A short real-time run: the media clock is recorded and scoring needs no override.
    rt = ["--dataset", str(data), "--response-root", str(tmp_path / "rt"), "--split", "RTD_OCR"]
    assert main(["generate", *rt, "--url", served.url, "--pace", "realtime"]) == 0
    meta = json.loads((tmp_path / "rt" / "RTD_OCR" / "ocr_0.meta.json").read_text())
    assert meta["clock"] == "media" and meta["units"] == 3
    rt_metrics = json.loads((tmp_path / "rt" / "duplex_metrics.json").read_text())["samples"][0]
    assert rt_metrics["wall_s"] >= 2.0  # three 1 s units, the second and third waited for their second
    assert main(["evaluate", *rt, "--score-root", str(tmp_path / "rt_scores"), *judge[2:]]) == 0
    assert (tmp_path / "rt_scores" / "RTD_OCR" / "ocr_0.json").exists()
