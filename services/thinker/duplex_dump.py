"""Duplex fidelity dump: ``python -m services.thinker dump --duplex --checkpoint DIR --inputs REF.npz --out F.npz``.

Runs the oracle's scripted duplex session (docs/fidelity.md, Duplex: the session prefix with the reference
voice, 5 units of 1 s audio, one camera frame in unit 2, the first unit forced to listen, greedy policy)
through the serving path's own objects: :class:`~services.thinker.duplex.DuplexSession` builds the
prefix and every unit (streaming mel, incremental Whisper, frames, token layout, policy), and a
:class:`~services.thinker.engine.ThinkerEngine` built by the stage's ``build_backend`` feeds them into its
paged KV cache and runs the policy, exactly as a duplex gRPC stream does. Only the stream plumbing
(queues, interrupts, the context window) is replaced by a synchronous loop, and the taps of
:mod:`services.thinker.duplex_tap` record what was fed and decided. The arrays carry the reference's
``duplex.*`` names (docs/fidelity.md, Dump keys), so they diff key by key against the upstream reference.

The engine defers a unit's terminator and ``</unit>`` to the start of the next unit (docs/model.md, Duplex);
the dump counts those two rows in the unit that decoded them, as the reference does, and feeds them for the
last unit once the session is over. ``--teacher-force`` feeds the reference's decoded ids instead of our
own (our choices are kept under ``duplex.uK.own_ids``), for bf16 or near-tie comparisons.
"""

from __future__ import annotations

import io
import json
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from services.common.checkpoint import SPECIAL_TOKEN_IDS
from services.common.pb import common_pb2, thinker_pb2
from services.thinker.duplex_policy import LISTEN
from services.thinker.duplex_tap import EncoderRecord, PolicyTap, RowRecord, RunnerTap, encoder_tap

UNITS = 5
UNIT_SAMPLES = 16_000
FRAME_UNIT = 2
FORCE_LISTEN_UNITS = 1
INSTRUCTIONS = "Streaming Omni Conversation."
UNIT_OPEN = SPECIAL_TOKEN_IDS["<unit>"]
UNIT_CLOSE = SPECIAL_TOKEN_IDS["</unit>"]


def _f32(t: torch.Tensor | np.ndarray) -> np.ndarray:
    return (
        t.detach().to("cpu", torch.float32).numpy()
        if isinstance(t, torch.Tensor)
        else np.asarray(t, np.float32)
    )


def _i64(x: Any) -> np.ndarray:
    return np.asarray(x.cpu() if isinstance(x, torch.Tensor) else x, dtype=np.int64)


def _pcm(samples: np.ndarray) -> common_pb2.Pcm:
    data = np.ascontiguousarray(samples, dtype="<f4").tobytes()
    return common_pb2.Pcm(sample_rate=16_000, format=common_pb2.PCM_FORMAT_F32LE, channels=1, data=data)


def _png(rgb: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.asarray(rgb, dtype=np.uint8)).save(buf, format="PNG")  # HxWx3 uint8: RGB
    return buf.getvalue()


def build_backend_for_dump(checkpoint: str, device: str, dtype: str, cuda_graphs: bool) -> Any:
    """The stage's own backend (model, processor, engine) with a small KV pool for one session."""
    from services.thinker.backend import build_backend
    from services.thinker.engine import EngineConfig

    cfg = EngineConfig(max_context=8192, max_num_seqs=2, use_cuda_graphs=cuda_graphs)
    cfg.kv_budget_bytes = 256 << 20  # one session of a few hundred rows (the tiny LLM: 1 KiB a row)
    backend = build_backend(checkpoint, device, dtype, cfg)
    # As the server does before serving: every graph bucket the session's steps can use is captured.
    backend.engine.runner.warmup_graphs(cfg.max_num_seqs, 1024)
    return backend


def _unit_message(audio: np.ndarray, k: int, frame_rgb: np.ndarray | None) -> thinker_pb2.ThinkerUnit:
    """Unit ``k`` of the session's audio, with the video frame when this unit carries one."""
    return thinker_pb2.ThinkerUnit(
        id=common_pb2.Identity(unit_seq=k),
        audio=_pcm(audio[k * UNIT_SAMPLES : (k + 1) * UNIT_SAMPLES]),
        frames=[_png(frame_rgb)] if frame_rgb is not None else [],
    )


def run_session(
    backend: Any,
    audio: np.ndarray,
    ref_audio: np.ndarray,
    frame_rgb: np.ndarray | None,
    *,
    units: int = UNITS,
    frame_unit: int = FRAME_UNIT,
    teacher: dict[int, list[int]] | None = None,
) -> dict[str, Any]:
    """Drive one session through ``DuplexSession`` + the engine; returns the raw records (see :func:`to_arrays`)."""
    from services.thinker.duplex import DuplexSession, UnitOutcome
    from services.thinker.duplex_encode import encode_unit
    from services.thinker.scheduler import WorkItem

    engine = backend.engine
    open_msg = thinker_pb2.ThinkerOpen(
        id=common_pb2.Identity(session_id="duplex-fidelity"),
        instructions=INSTRUCTIONS,
        ref_audio=_pcm(ref_audio),
        force_listen_units=FORCE_LISTEN_UNITS,
        want_speech=True,
        sampling=thinker_pb2.SamplingParams(temperature=0.0),
    )
    runner_tap = RunnerTap(engine.runner)
    events: list[Any] = []
    out: dict[str, Any] = {"units": [], "kv_len": [], "work_rows": []}

    def run(seq: Any, work: Any) -> list[Any]:
        n = len(events)
        out["work_rows"].append((len(seq.tokens), list(work.token_ids)))
        engine.submit(seq, work)
        engine.run_until_idle()
        new = events[n:]
        for ev in new:
            if ev.error is not None:
                raise RuntimeError(f"duplex dump: engine error {ev.error}")
        return new

    with (
        runner_tap.installed() as rows,
        encoder_tap(backend.model) as enc,
        PolicyTap(rows).installed() as pol,
    ):
        session = DuplexSession(backend, open_msg)
        seq = engine.open(events.append, persistent=True)
        try:
            run(seq, session.prefix_work())
            out["kv_len"].append(len(seq.tokens))
            for k in range(units):
                frame = frame_rgb if k == frame_unit else None
                work = encode_unit(backend, session, _unit_message(audio, k, frame), False)
                d0 = len(pol.decodes)
                pol.forced = None if teacher is None else list(teacher.get(k, []))
                outcome = UnitOutcome()
                for ev in run(seq, work):
                    outcome.absorb(ev)
                responses = session.unit_responses(k, outcome, len(seq.tokens))
                result = next(r.unit for r in responses if r.HasField("unit"))
                # The engine has fed this unit up to its last decoded token; the session owes the rest.
                out["kv_len"].append(len(seq.tokens) + len(session.reinject))
                out["units"].append(
                    {
                        "generated": list(outcome.generated),
                        "finish": outcome.finish,
                        "result": result,
                        "decodes": pol.decodes[d0:],
                    }
                )
            # The last unit's terminator and </unit>, which a next unit would have re-injected.
            run(seq, WorkItem(list(session.reinject), None, sampler=None, tag="close"))
        finally:
            engine.close(seq)
            engine.run_until_idle()
    out.update(rows=rows, enc=enc)
    return out


def to_arrays(rec: dict[str, Any], inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The ``duplex.*`` keys (docs/fidelity.md, Dump keys) from the records of :func:`run_session`."""
    rows: RowRecord = rec["rows"]
    enc: EncoderRecord = rec["enc"]
    total = len(rows.ids)
    if sorted(rows.ids) != list(range(total)):
        raise RuntimeError("duplex dump: the fed positions are not contiguous")
    ids = [rows.ids[p] for p in range(total)]
    nan = torch.full_like(rows.embeds[0], float("nan"))
    out: dict[str, np.ndarray] = dict(inputs)
    out["duplex.session_input_ids"] = _i64(ids)
    out["duplex.session_inputs_embeds"] = _f32(torch.stack([rows.embeds[p] for p in range(total)]))
    hidden = torch.stack([rows.hidden.get(p, nan) for p in range(total)])
    out["duplex.session_hidden"] = _f32(hidden)
    out["duplex.kv_len"] = _i64(rec["kv_len"])
    works = rec["work_rows"]  # (first row, token ids) of the prefix, each unit, the closing feed
    merges = enc.merges  # prefix, then one per unit
    prefix_len = rec["kv_len"][0]
    out["duplex.prefix.input_ids"] = _i64(ids[:prefix_len])
    out["duplex.prefix.audio_bounds"] = _i64(merges[0]["audio_bounds"]).reshape(-1, 2)
    ra = enc.ref_audio[0]
    out["duplex.prefix.ref_audio_features"] = _f32(ra["features"])
    out["duplex.prefix.ref_audio_feature_lens"] = _i64(ra["lens"])
    out["duplex.prefix.ref_audio_embeds"] = _f32(ra["rows"])
    spans, decisions, is_listen, eot, whisper = [], [], [], [], []
    vision = iter(enc.vision)
    for k, unit in enumerate(rec["units"]):
        first, toks = works[k + 1]
        nxt_first, nxt_toks = works[k + 2]
        start = first + toks.index(UNIT_OPEN)
        end = nxt_first + nxt_toks.index(UNIT_CLOSE) + 1  # this unit's </unit>, fed with the next item
        spans.append((start, end))
        p = f"duplex.u{k}."
        out[p + "input_ids"] = _i64(ids[start:end])
        m = merges[k + 1]
        shift = first - start
        out[p + "audio_bounds"] = _i64(m["audio_bounds"] + shift).reshape(-1, 2)
        if m["image_bounds"].numel():
            out[p + "image_bounds"] = _i64(m["image_bounds"] + shift).reshape(-1, 2)
            v = next(vision)
            for j, pv in enumerate(v["pixel_values"]):
                out[p + f"pixel_values.{j}"] = _f32(pv)
            out[p + "tgt_sizes"] = _i64(v["tgt_sizes"]).reshape(-1, 2)
            out[p + "vision_embeds"] = _f32(v["embeds"])
        a = enc.audio[k]
        out[p + "audio_features"] = _f32(a["features"])[None]
        out[p + "audio_embeds"] = _f32(a["rows"])
        whisper.append(a["whisper_frames"])
        drow = first + int(m["audio_bounds"][-1, 1]) - 1  # the last audio row: where the decision is read
        out[p + "decision_hidden"] = _f32(hidden[drow])
        out[p + "decision_logits"] = _f32(rows.logits[drow])
        dec = unit["decodes"]
        out[p + "decode_ids"] = _i64([d.token for d in dec])
        out[p + "decode_rows"] = _i64([d.row for d in dec])
        out[p + "decode_margins"] = _f32(np.asarray([d.margin for d in dec], np.float32))
        out[p + "decode_raw_argmax"] = _i64([d.raw_argmax for d in dec])
        out[p + "own_ids"] = _i64([d.own for d in dec])
        decisions.append(ids[drow + 1])
        gen = unit["generated"]
        # streaming_generate's is_listen: the unit ended on <|listen|>; end_of_turn: the serving path's
        # UnitResult.turn_end.
        is_listen.append(bool(gen) and gen[-1] == LISTEN)
        eot.append(bool(unit["result"].turn_end))
    out["duplex.unit_spans"] = _i64(spans).reshape(-1, 2)
    out["duplex.decisions"] = _i64(decisions)
    out["duplex.is_listen"] = np.asarray(is_listen, dtype=bool)
    out["duplex.end_of_turn"] = np.asarray(eot, dtype=bool)
    out["duplex.whisper_kv_len"] = _i64(whisper)
    return out


def load_inputs(path: str) -> dict[str, np.ndarray]:
    """The three ``duplex.inputs.*`` arrays of a reference file."""
    with np.load(path) as ref:
        return {
            k: ref[k]
            for k in ("duplex.inputs.audio_16k", "duplex.inputs.ref_audio_16k", "duplex.inputs.frame_rgb")
        }


def teacher_ids(path: str) -> dict[int, list[int]]:
    """Per unit, the ids the reference's policy returned (``duplex.uK.decode_ids``)."""
    with np.load(path) as ref:
        return {int(k.split(".")[1][1:]): ref[k].tolist() for k in ref.files if k.endswith(".decode_ids")}


def build_duplex_dump(
    checkpoint: str,
    inputs: dict[str, np.ndarray],
    *,
    device: str = "cpu",
    dtype: str = "float32",
    cuda_graphs: bool = False,
    units: int = UNITS,
    frame_unit: int = FRAME_UNIT,
    teacher: dict[int, list[int]] | None = None,
) -> dict[str, np.ndarray]:
    """Every ``duplex.*`` array of the dump plus ``meta_json``."""
    t0 = time.time()
    backend = build_backend_for_dump(checkpoint, device, dtype, cuda_graphs)
    try:
        rec = run_session(
            backend,
            inputs["duplex.inputs.audio_16k"],
            inputs["duplex.inputs.ref_audio_16k"],
            inputs.get("duplex.inputs.frame_rgb"),
            units=units,
            frame_unit=frame_unit,
            teacher=teacher,
        )
    finally:
        backend.executor.shutdown(wait=False)
    out = to_arrays(rec, inputs)
    meta = {
        "checkpoint": str(checkpoint),
        "device": device,
        "dtype": dtype,
        "cuda_graphs": cuda_graphs,
        "units": units,
        "frame_unit": frame_unit,
        "teacher_forced": teacher is not None,
        "step_counts": dict(getattr(backend.engine.runner, "step_counts", {})),
        "hidden_rows_recorded": int(np.isfinite(out["duplex.session_hidden"]).all(axis=1).sum()),
        "unit_finish": [u["finish"] for u in rec["units"]],
        "seconds": round(time.time() - t0, 2),
    }
    out["meta_json"] = np.asarray(json.dumps(meta))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    from services.thinker.dump import apply_threads, dump_parser

    parser = dump_parser("python -m services.thinker dump --duplex", __doc__.splitlines()[0])
    parser.add_argument("--inputs", required=True, help="reference .npz holding the duplex.inputs.* arrays")
    parser.add_argument("--units", type=int, default=UNITS, help="units of the session (the oracle runs 5)")
    parser.add_argument("--frame-unit", type=int, default=FRAME_UNIT, help="the unit that carries the frame")
    parser.add_argument("--cuda-graphs", action="store_true", help="let the engine replay CUDA graphs")
    parser.add_argument("--teacher-force", action="store_true", help="feed the --inputs file's decode ids")
    args = parser.parse_args(argv)
    apply_threads(args.threads)
    arrays = build_duplex_dump(
        args.checkpoint,
        load_inputs(args.inputs),
        device=args.device,
        dtype=args.dtype,
        cuda_graphs=args.cuda_graphs,
        units=args.units,
        frame_unit=args.frame_unit,
        teacher=teacher_ids(args.inputs) if args.teacher_force else None,
    )
    np.savez(args.out, **arrays)
    print(f"wrote {len(arrays)} arrays to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
