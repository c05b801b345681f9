"""The committed stubs must equal what grpcio-tools generates from protos/ (one source of truth)."""

from __future__ import annotations

from pathlib import Path

from services.common.pb.generate import generate

PB_DIR = Path(__file__).resolve().parents[1] / "services" / "common" / "pb"


def test_committed_stubs_are_fresh(tmp_path: Path) -> None:
    fresh = generate(tmp_path)
    assert fresh, "no stubs generated"
    for path in fresh:
        committed = PB_DIR / path.name
        assert committed.is_file(), f"{committed} missing: run python -m services.common.pb.generate"
        assert committed.read_text() == path.read_text(), (
            f"{committed.name} is stale: run python -m services.common.pb.generate and commit"
        )
