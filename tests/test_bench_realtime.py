"""The realtime duplex bench on CPU: one short launch-mode run through the real stages and gateway."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_realtime_bench_launches_the_pipeline_and_reports_both_lanes(tiny_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "realtime"
    cmd = [
        sys.executable,
        "-m",
        "bench.realtime_duplex",
        "--checkpoint",
        str(tiny_ckpt),
        "--deploy-config",
        "cpu",
        "--device",
        "cpu",
        "--sessions",
        "1",
        "--units",
        "3",
        "--duration",
        "1",
        "--warmup",
        "0",
        "--out-dir",
        str(out),
    ]
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    turn, native = json.loads((out / "realtime.json").read_text())["levels"]
    assert (turn["lane"], native["lane"]) == ("turn", "native")
    assert turn["sessions"] == 1 and turn["failed"] == 0, turn
    # One cycle: a whole response, then one barged in at its first audio delta.
    assert turn["responses"] == 2 and turn["completed"] == 1
    assert turn["first_audio_s"]["n"] == 2 and turn["barge_in_ms"]["n"] == 1
    assert turn["unit_rtf"] is not None and set(turn["unit_rtf"]) == {"p50", "p90", "p99", "n"}
    assert turn["underruns_per_session"]["n"] == 1 and turn["underruns_total"] >= 0
    assert turn["unit_decision_mean_ms"] > 0 and turn["gateway_barge_in_mean_ms"] is not None
    # The first-audio split at the gateway: speech chunk, then the talker's window, then code2wav's audio
    # (the unit's decision arrives right behind its speech chunk).
    split = {k: turn[f"first_audio_{k}_mean_ms"] for k in ("decision", "speech", "window", "audio")}
    assert all(v is not None and v > 0 for v in split.values()), split
    assert split["speech"] <= split["window"] <= split["audio"] <= 1000 * turn["first_audio_s"]["p90"] + 1
    # The thinker's drain histogram is scraped from its own metrics port (0 when no unit was running).
    assert turn["thinker_drain_mean_ms"] is not None and turn["thinker_drain_mean_ms"] >= 0
    # The thinker's unit split (queued / encode / behind / engine) and step split (forward / sample) are
    # scraped; "behind" may be zero when every unit was encoded after the previous decision.
    assert turn["thinker_unit_behind_mean_ms"] is not None and turn["thinker_unit_behind_mean_ms"] >= 0
    for key in (
        "thinker_unit_encode_mean_ms",
        "thinker_unit_engine_mean_ms",
        "thinker_step_forward_mean_ms",
        "thinker_step_sample_mean_ms",
    ):
        assert turn[key] is not None and turn[key] > 0, key
    assert turn["whisper_batch_mean"] == 1.0  # one session: one unit per streaming-Whisper pass
    for stage in ("thinker", "talker", "code2wav"):
        assert turn[f"{stage}_batch_mean"] >= 1 and 0 < turn[f"{stage}_busy_share"] < 1, stage
    # The native lane: every response the model opened completed (the final commit's silence clock).
    assert native["failed"] == 0 and native["completed"] == native["responses"], native
    md = (out / "realtime.md").read_text()
    assert md.startswith("| sessions |") and "| 1 | native |" in md
    assert "Thinker unit split at 1 sessions (turn; mean ms): unit sent to decision " in md
    # Code2wav's late later windows are scraped (how many depends on the CPU's speed, so only present).
    assert turn["code2wav_late_arrived_windows"] >= 0 and turn["code2wav_late_done_windows"] >= 0
    assert "Code2wav later windows past their deadline at 1 sessions (turn; " in md
    # Every response's first window went through code2wav: its arrival-to-audio mean is scraped.
    assert turn["code2wav_first_window_mean_ms"] is not None and turn["code2wav_first_window_mean_ms"] > 0
    assert "Code2wav first windows at 1 sessions (turn): arrival at the stage to audio routed " in md
    for pid in json.loads((out / "logs" / "pids.json").read_text()).values():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_code2wav_late_windows_are_counted_and_averaged_per_level() -> None:
    """The late-window histogram's count is the number of late windows and its mean their lateness; a
    phase with none reads 0 windows and no mean."""
    from bench.realtime_duplex import _metric_means, render_markdown

    done = 'minicpmo_code2wav_late_window_seconds_{}{{phase="done"}}'
    first = "minicpmo_code2wav_first_window_seconds_{}"
    sums = {
        done.format("count"): 3.0,
        done.format("sum"): 0.6,
        first.format("count"): 4.0,
        first.format("sum"): 0.5,
    }
    out = _metric_means(sums, wall=60.0)
    assert out["code2wav_first_window_mean_ms"] == pytest.approx(125.0)
    assert out["code2wav_late_done_windows"] == 3.0
    assert out["code2wav_late_done_mean_ms"] == pytest.approx(200.0)
    assert out["code2wav_late_arrived_windows"] == 0.0 and out["code2wav_late_arrived_mean_ms"] is None
    level = {
        "sessions": 16,
        "lane": "turn",
        "failed": 0,
        "unit_rtf": None,
        "underruns_per_session": None,
        "first_audio_s": None,
        "barge_in_ms": None,
        **out,
    }
    md = render_markdown([level])
    assert "at 16 sessions (turn; the listener starting at the first audio, without the client" in md
    assert "arrived 0 (mean - ms); done 3 (mean 200 ms)" in md
    assert "Code2wav first windows at 16 sessions (turn): arrival at the stage to audio routed 125.0 ms" in md


def test_thinker_steps_are_counted_by_path_per_level() -> None:
    """The step-path histogram gives each path's step count and mean forward time; the level's report
    prints them (an eager step in a duplex level is a step too large for the row graphs)."""
    from bench.realtime_duplex import STEP_PATHS, _metric_means, render_markdown
    from services.thinker.runner import STEP_PATHS as RUNNER_PATHS

    assert STEP_PATHS == RUNNER_PATHS  # the bench's copy of the runner's labels
    path = 'minicpmo_thinker_step_path_seconds_{}{{path="{}"}}'
    sums = {
        path.format("count", "graph"): 900.0,
        path.format("sum", "graph"): 7.2,
        path.format("count", "eager"): 4.0,
        path.format("sum", "eager"): 0.16,
    }
    out = _metric_means(sums, wall=60.0)
    assert out["thinker_steps_graph"] == 900.0 and out["thinker_step_graph_mean_ms"] == pytest.approx(8.0)
    assert out["thinker_steps_eager"] == 4.0 and out["thinker_step_eager_mean_ms"] == pytest.approx(40.0)
    assert out["thinker_steps_graph_mixed"] == 0.0 and out["thinker_step_graph_mixed_mean_ms"] is None
    level = {"sessions": 16, "lane": "turn", "failed": 0, "unit_rtf": None, "underruns_per_session": None,
             "first_audio_s": None, "barge_in_ms": None, **out}  # fmt: skip
    md = render_markdown([level])
    assert (
        "Thinker steps at 16 sessions (turn; forward): graph 900 (mean 8.00 ms); graph_mixed 0 (mean - ms); "
        "eager 4 (mean 40.00 ms)" in md
    )


def test_a_level_past_its_deadline_keeps_what_its_sessions_measured(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A session still running at the level's deadline is stopped and returned with the responses it
    measured and an ``unfinished`` error; a session that ended is returned as it is; progress lines show
    the level while it runs."""
    import argparse
    import asyncio

    from bench import realtime_duplex
    from bench.realtime_workload import ResponseClock, SessionResult

    calls = {"n": 0}

    async def script(plan, result):  # noqa: ANN001, ANN202
        calls["n"] += 1
        clock = ResponseClock(started=0.0)
        clock.unit_rtf.extend([0.5, 0.7])
        clock.status = "completed"
        result.responses.append(clock)
        if calls["n"] == 2:
            await asyncio.sleep(3600)  # a session that never finishes
        return result

    monkeypatch.setattr(realtime_duplex, "turn_session", script)
    monkeypatch.setattr(realtime_duplex, "PROGRESS_EVERY_S", 0.1)
    args = argparse.Namespace(url="ws://x", duration=0.0, units=3, level_timeout=0.35)
    out = asyncio.run(realtime_duplex._sessions(args, "turn", 2, "data:"))
    assert all(isinstance(r, SessionResult) for r in out)
    assert out[0].errors == [] and len(out[0].responses) == 1
    assert [e["code"] for e in out[1].errors] == ["unfinished"] and out[1].responses[0].unit_rtf == [0.5, 0.7]
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "sessions finished" in ln]
    assert lines and "1/2 sessions finished, 2 responses done, unit RTF p90" in lines[-1]
    assert realtime_duplex.level_deadline(argparse.Namespace(duration=60.0, level_timeout=None)) == 240.0


def test_stagger_spreads_the_session_starts_evenly(monkeypatch: pytest.MonkeyPatch) -> None:
    """--stagger-s 0.4 over 4 sessions: session i waits i x 0.1 s before it starts; without it none waits.
    The waits are read from the sleeps the sessions ask for, not from a clock."""
    import argparse
    import asyncio

    from bench import realtime_duplex
    from bench.realtime_workload import SessionResult

    real_sleep = asyncio.sleep

    def run(stagger_s: float) -> list[float]:
        waits: list[float] = []
        started: list[int] = []

        async def sleep(delay: float) -> None:
            waits.append(delay)
            await real_sleep(0)

        async def script(plan, result):  # noqa: ANN001, ANN202
            started.append(len(waits))
            return result

        monkeypatch.setattr(realtime_duplex.asyncio, "sleep", sleep)
        monkeypatch.setattr(realtime_duplex, "turn_session", script)
        args = argparse.Namespace(url="ws://x", duration=0.0, units=3, level_timeout=5.0, stagger_s=stagger_s)
        out = asyncio.run(realtime_duplex._sessions(args, "turn", 4, "data:"))
        monkeypatch.setattr(realtime_duplex.asyncio, "sleep", real_sleep)
        assert all(isinstance(r, SessionResult) for r in out) and len(started) == 4
        return waits

    assert [round(w, 6) for w in run(0.4)] == [0.0, 0.1, 0.2, 0.3]
    assert run(0.0) == [0.0, 0.0, 0.0, 0.0]
