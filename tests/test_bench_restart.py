"""bench.restart's bookkeeping without a pipeline: a launcher that exits mid-run ends the run with an error
in the report (not a traceback), and a stage restarted with the killed one waits out its own STABLE_S."""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys

import pytest

from bench import restart


class _FakeLauncher:
    """What bench.restart reads of the launcher: its log text, its children, its process."""

    def __init__(self, log: str, child_pid: int, alive: bool) -> None:
        self.port = 9  # discard: nothing answers there
        self._log = log
        self._child_pid = child_pid
        cmd = [sys.executable, "-c", "import time; time.sleep(60)" if alive else "pass"]
        self.proc = subprocess.Popen(cmd)
        if not alive:
            self.proc.wait(30)

    def text(self) -> str:
        return self._log

    def children(self) -> dict[str, tuple[int, int]]:
        return {f"{s}-0": (9, self._child_pid) for s in restart.STAGES}


def _victim() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def _args(**kw: object) -> argparse.Namespace:
    base = {"streams": 0, "warm_s": 0.0, "runs": 1, "stages": ["code2wav"], "pause_s": 0.0, "give_up_s": 5.0}
    return argparse.Namespace(**{**base, **kw})


def test_a_launcher_that_exits_ends_the_run_with_an_error_in_the_report(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("gateway.launcher.STABLE_S", 0.0)
    victim = _victim()
    launcher = _FakeLauncher("", victim.pid, alive=False)
    report = asyncio.run(restart.run(_args(), launcher))  # type: ignore[arg-type]
    assert victim.wait(10) < 0  # it was SIGKILLed
    assert report["runs"] == [] and report["worst_served_s"] == {"code2wav": None}
    assert "the launcher exited" in report["error"]


def test_a_stage_that_is_never_served_again_gives_up(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("gateway.launcher.STABLE_S", 0.0)
    victim = _victim()
    launcher = _FakeLauncher("", victim.pid, alive=True)
    try:
        report = asyncio.run(restart.run(_args(give_up_s=0.5), launcher))  # type: ignore[arg-type]
    finally:
        launcher.proc.kill()
    assert "not serving 0.5 s after the kill" in report["error"]


def test_a_run_passes_only_with_every_figure_in_bound_and_a_clean_launcher_exit() -> None:
    good = {"worst_served_s": {"code2wav": 8.0, "talker": 9.9}, "launcher_exit": 0}
    assert restart.passed(good, 10.0)
    assert not restart.passed({**good, "launcher_exit": 1}, 10.0)
    assert not restart.passed({**good, "worst_served_s": {"code2wav": 10.5}}, 10.0)
    assert not restart.passed({**good, "worst_served_s": {"code2wav": None}}, 10.0)
    assert not restart.passed({**good, "error": "the launcher exited 3.0 s after code2wav was killed"}, 10.0)
