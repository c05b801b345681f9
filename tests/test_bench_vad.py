"""bench.vad runs both detectors over streamed audio and writes its report (the harness, not the speed)."""

from __future__ import annotations

import json
from pathlib import Path

from bench.vad import main


def test_bench_vad_reports_both_detectors(tmp_path: Path) -> None:
    assert main(["--seconds", "2", "--repeats", "1", "--out-dir", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "vad.json").read_text())
    rows = {r["detector"]: r for r in report["results"]}
    assert set(rows) == {"silero", "energy"}
    assert rows["silero"]["frame_ms"] == 32 and rows["silero"]["frames"] == 2 * 16_000 // 512
    assert rows["energy"]["frame_ms"] == 20 and rows["energy"]["frames"] == 100
    assert all(r["cpu_us_per_20ms"] > 0 for r in rows.values())
    assert "| silero | 32 ms |" in (tmp_path / "vad.md").read_text()
