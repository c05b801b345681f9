"""Compare two ``.npz`` dumps key by key: the fidelity check of docs/fidelity.md.

``python -m bench.compare_npz REF.npz OUT.npz [--keys PREFIX ...] [--atol 1e-4] [--rtol 1e-4]`` prints one
row per key of the reference that matches a prefix: its shape, and either ``identical`` (integer and
boolean arrays must be equal) or the largest absolute difference and that difference relative to the
reference's largest magnitude (float arrays must satisfy ``|out - ref| <= atol + rtol * |ref|``). A key
missing from the output, a shape mismatch or a value outside the tolerance fails the row; the exit code
is 1 when any row failed. The reference dumps come from the upstream code (docs/fidelity.md); the
project's own ``dump`` subcommands write the output side under the same keys.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import numpy as np


def compare_arrays(ref: np.ndarray, out: np.ndarray, atol: float, rtol: float) -> tuple[str, str, str, bool]:
    """One row's (max_abs, rel, note, ok) text for a reference array and the output array of the same key."""
    if ref.shape != out.shape:
        return "", "", f"shape {out.shape}", False
    if ref.dtype.kind in "biuSUO" or out.dtype.kind in "biuSUO":
        same = bool(np.array_equal(ref, out))
        return "", "", "identical" if same else "differs", same
    r = ref.astype(np.float64)
    o = out.astype(np.float64)
    if r.size == 0:
        return "0.000e+00", "0.000e+00", "", True
    diff = np.abs(o - r)
    max_abs = float(diff.max())
    scale = float(np.abs(r).max())
    rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else float("inf"))
    ok = bool(np.all(diff <= atol + rtol * np.abs(r))) and bool(np.all(np.isfinite(o) == np.isfinite(r)))
    return f"{max_abs:.3e}", f"{rel:.3e}", "", ok


def compare_files(
    ref_path: str, out_path: str, prefixes: Sequence[str], atol: float, rtol: float
) -> tuple[list[str], bool]:
    """The report lines and whether every compared key passed."""
    ref = np.load(ref_path, allow_pickle=False)
    out = np.load(out_path, allow_pickle=False)
    keys = sorted(k for k in ref.files if not prefixes or any(k.startswith(p) for p in prefixes))
    lines = [f"{'key':<52} {'shape':>12} {'max_abs':>10} {'rel':>10}  ok"]
    all_ok = bool(keys)
    for key in keys:
        shape = str(tuple(ref[key].shape))
        if key not in out.files:
            lines.append(f"{key:<52} {shape:>12} {'missing':>21}  FAIL")
            all_ok = False
            continue
        max_abs, rel, note, ok = compare_arrays(ref[key], out[key], atol, rtol)
        cols = f"{max_abs:>10} {rel:>10}" if not note else f"{note:>21}"
        lines.append(f"{key:<52} {shape:>12} {cols}  {'ok' if ok else 'FAIL'}")
        all_ok = all_ok and ok
    if not keys:
        lines.append(f"no key of {ref_path} matches {list(prefixes)}")
    return lines, all_ok


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("reference", help="the reference .npz")
    ap.add_argument("output", help="the project's .npz")
    ap.add_argument("--keys", nargs="*", default=[], help="key prefixes to compare (default: every key)")
    ap.add_argument("--atol", type=float, default=1e-4)
    ap.add_argument("--rtol", type=float, default=1e-4)
    args = ap.parse_args(argv)
    lines, ok = compare_files(args.reference, args.output, args.keys, args.atol, args.rtol)
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
