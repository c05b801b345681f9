"""Duplex fidelity of the GPU path: the oracle's scripted session through the thinker (bf16, CUDA graphs).

    python -m bench.duplex_fidelity --checkpoint DIR --reference REF-DUPLEX.npz [--device cuda]
        [--runs bf16-graphs-tf,bf16-graphs-free,fp32-graphs-tf] [--out-dir DIR]

``DIR`` is the oracle's tiny checkpoint and ``REF-DUPLEX.npz`` the upstream reference of that checkpoint
(fp32, CPU; docs/fidelity.md says how both are built). Each run is ``services.thinker.duplex_dump`` on the
device: the session through ``DuplexSession`` and the engine, with CUDA graphs warmed up as the server
does. ``-tf`` runs are teacher-forced (the policy returns the reference's ids, so every row stays
comparable); ``-free`` runs feed their own choices and stop being comparable after the first flip.

Per unit it reports the largest |difference| and the smallest cosine of the final hidden rows (every row a
step exposed: eager steps and graph replays give all rows), of the decision hidden, of the decision logits
(full vocabulary) and of the audio/vision rows fed, and every decode step whose own choice differs from
the reference's id (a flip), with the reference's fp32 margin and ours. Results go to ``--out-dir`` (else
``$OUT``, else the current directory) as ``duplex_fidelity.json`` and ``duplex_fidelity.md``. Exits 0 when
it ran (flips are findings, not failures); 2 when no CUDA device is there and ``--device cuda``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

RUNS = {
    "bf16-graphs-tf": ("bfloat16", True, True),
    "bf16-graphs-free": ("bfloat16", True, False),
    "fp32-graphs-tf": ("float32", True, True),
    "bf16-eager-tf": ("bfloat16", False, True),
}


def _diff(ref: np.ndarray, ours: np.ndarray) -> dict[str, float]:
    """Largest |a - b|, relative to the reference's largest |value|, and the smallest row cosine."""
    ref = np.asarray(ref, np.float64).reshape(-1, ref.shape[-1]) if ref.ndim else ref
    ours = np.asarray(ours, np.float64).reshape(ref.shape)
    keep = np.isfinite(ours).all(axis=-1)
    if not keep.any():
        return {"rows": 0}
    r, o = ref[keep], ours[keep]
    cos = (r * o).sum(-1) / np.maximum(np.linalg.norm(r, axis=-1) * np.linalg.norm(o, axis=-1), 1e-30)
    diff = float(np.abs(r - o).max())
    return {
        "rows": int(keep.sum()),
        "max_abs": diff,
        "rel_to_max": diff / max(float(np.abs(r).max()), 1e-30),
        "min_cos": float(cos.min()),
    }


def compare(ref: Any, ours: dict[str, np.ndarray]) -> dict[str, Any]:
    """Per-unit differences and flips of one run against the reference."""
    spans = ref["duplex.unit_spans"]
    units = []
    for k, (s, e) in enumerate(spans):
        p = f"duplex.u{k}."
        ids_equal = bool(np.array_equal(ref[p + "input_ids"], ours.get(p + "input_ids", np.zeros(0))))
        unit: dict[str, Any] = {
            "unit": k,
            "ids_equal": ids_equal,
            "hidden": _diff(ref["duplex.session_hidden"][s:e], ours["duplex.session_hidden"][s:e])
            if ids_equal
            else None,
            "decision_hidden": _diff(ref[p + "decision_hidden"][None], ours[p + "decision_hidden"][None]),
            "decision_logits": _diff(ref[p + "decision_logits"][None], ours[p + "decision_logits"][None]),
            "audio_embeds": _diff(ref[p + "audio_embeds"], ours[p + "audio_embeds"]),
        }
        if p + "vision_embeds" in ref.files:
            unit["vision_embeds"] = _diff(ref[p + "vision_embeds"][0], ours[p + "vision_embeds"][0])
        flips = []
        ref_ids, ref_m = ref[p + "decode_ids"], ref[p + "decode_margins"]
        own, own_m = ours[p + "own_ids"], ours[p + "decode_margins"]
        for j in range(min(len(ref_ids), len(own))):
            if int(own[j]) != int(ref_ids[j]):
                flips.append(
                    {
                        "step": j,
                        "reference": int(ref_ids[j]),
                        "ours": int(own[j]),
                        "reference_margin": float(ref_m[j]),
                        "our_margin": float(own_m[j]),
                    }
                )
        unit["decode_steps"] = int(len(own))
        unit["flips"] = flips
        unit["min_reference_margin"] = float(ref_m.min()) if len(ref_m) else None
        units.append(unit)
    return {
        "prefix_hidden": _diff(
            ref["duplex.session_hidden"][: ref["duplex.kv_len"][0]],
            ours["duplex.session_hidden"][: ours["duplex.kv_len"][0]],
        ),
        "ref_audio_embeds": _diff(
            ref["duplex.prefix.ref_audio_embeds"], ours["duplex.prefix.ref_audio_embeds"]
        ),
        "decisions_equal": bool(np.array_equal(ref["duplex.decisions"], ours["duplex.decisions"])),
        "units": units,
    }


def _fmt(d: dict[str, Any] | None) -> str:
    if not d or not d.get("rows"):
        return "—"
    return f"{d['max_abs']:.2e} ({d['rel_to_max']:.1e} rel, cos {d['min_cos']:.5f})"


def markdown(results: dict[str, Any]) -> str:
    lines = [f"# duplex fidelity ({results['device']}, torch {results['torch']})", ""]
    for name, run in results["runs"].items():
        c, meta = run["comparison"], run["meta"]
        lines += [
            f"## {name}: dtype {meta['dtype']}, CUDA graphs {meta['cuda_graphs']}, teacher-forced "
            f"{meta['teacher_forced']}; steps {meta['step_counts']}; hidden rows recorded "
            f"{meta['hidden_rows_recorded']}; {run['seconds']} s",
            "",
            f"prefix hidden {_fmt(c['prefix_hidden'])}; reference voice rows {_fmt(c['ref_audio_embeds'])}; "
            f"decisions equal: {c['decisions_equal']}",
            "",
            "| unit | hidden (unit rows) | decision hidden | decision logits | audio rows | flips (step: ref→ours, "
            "ref margin / ours) |",
            "|---|---|---|---|---|---|",
        ]
        for u in c["units"]:
            flips = (
                "; ".join(
                    f"{f['step']}: {f['reference']}→{f['ours']}, {f['reference_margin']:.4f} / {f['our_margin']:.4f}"
                    for f in u["flips"]
                )
                or "none"
            )
            vis = f" (vision {_fmt(u['vision_embeds'])})" if "vision_embeds" in u else ""
            lines.append(
                f"| {u['unit']} | {_fmt(u['hidden']) if u['ids_equal'] else 'ids differ'} | "
                f"{_fmt(u['decision_hidden'])} | {_fmt(u['decision_logits'])} | {_fmt(u['audio_embeds'])}{vis} | "
                f"{flips} |"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from services.thinker.duplex_dump import build_duplex_dump, load_inputs, teacher_ids

    ap = argparse.ArgumentParser(prog="python -m bench.duplex_fidelity", description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--reference", required=True, help="the oracle's REF-DUPLEX.npz for that checkpoint")
    ap.add_argument("--device", default="cuda")
    ap.add_argument(
        "--runs", default="bf16-graphs-tf,bf16-graphs-free,fp32-graphs-tf", help=f"of {list(RUNS)}"
    )
    ap.add_argument("--out-dir", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("skipped: no CUDA")
        return 2
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 runs stay fp32 (the reference has no TF32)
        torch.backends.cudnn.allow_tf32 = False
    inputs, teacher = load_inputs(args.reference), teacher_ids(args.reference)
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device,
        "torch": torch.__version__,
        "runs": {},
    }
    with np.load(args.reference) as ref:
        for name in args.runs.split(","):
            dtype, graphs, tf = RUNS[name]
            t0 = time.time()
            ours = build_duplex_dump(
                args.checkpoint,
                inputs,
                device=args.device,
                dtype=dtype,
                cuda_graphs=graphs,
                teacher=teacher if tf else None,
            )
            meta = json.loads(str(ours.pop("meta_json")))
            results["runs"][name] = {
                "meta": meta,
                "seconds": round(time.time() - t0, 1),
                "comparison": compare(ref, ours),
            }
            print(f"{name}: {round(time.time() - t0, 1)} s", flush=True)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "duplex_fidelity.json").write_text(json.dumps(results, indent=1) + "\n")
    md = markdown(results)
    (out / "duplex_fidelity.md").write_text(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
