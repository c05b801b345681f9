"""bench.compare_npz, the fidelity comparison of docs/fidelity.md: equal, within tolerance, outside it,
missing keys, shape mismatches and integer arrays that differ."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from bench.compare_npz import compare_files, main


def _write(path: Path, **arrays: np.ndarray) -> str:
    np.savez(path, **arrays)
    return str(path)


def test_within_tolerance_passes_and_reports_each_key(tmp_path: Path) -> None:
    ref = _write(
        tmp_path / "ref.npz",
        **{"a.x": np.ones((2, 3)), "a.ids": np.arange(4), "b.y": np.zeros(2)},
    )
    out = _write(
        tmp_path / "out.npz",
        **{"a.x": np.ones((2, 3)) + 5e-5, "a.ids": np.arange(4), "b.y": np.ones(2)},
    )
    lines, ok = compare_files(ref, out, ["a."], 1e-4, 1e-4)
    assert ok
    assert len(lines) == 3 and "identical" in lines[1] and "5.000e-05" in lines[2]
    assert main([ref, out, "--keys", "a."]) == 0
    assert main([ref, out]) == 1  # b.y is 1 away from 0


def test_failures_missing_shape_and_integer_differences(tmp_path: Path) -> None:
    ref = _write(
        tmp_path / "ref.npz", x=np.zeros(3), ids=np.array([1, 2, 3]), gone=np.zeros(1), s=np.zeros((2, 2))
    )
    out = _write(tmp_path / "out.npz", x=np.full(3, 1e-3), ids=np.array([1, 2, 4]), s=np.zeros((4,)))
    lines, ok = compare_files(ref, out, [], 1e-4, 1e-4)
    assert not ok
    rows = {line.split()[0]: line for line in lines[1:]}
    assert rows["x"].endswith("FAIL") and rows["ids"].endswith("FAIL") and "differs" in rows["ids"]
    assert "missing" in rows["gone"] and "shape (4,)" in rows["s"]


def test_no_matching_key_fails(tmp_path: Path) -> None:
    ref = _write(tmp_path / "ref.npz", x=np.zeros(1))
    assert main([ref, ref, "--keys", "thinker."]) == 1
