"""The duplex fidelity dump (``python -m services.thinker dump --duplex``) stays internally consistent.

The numeric comparison with upstream's ``MiniCPMODuplex`` needs the upstream code and runs outside CI
(docs/fidelity.md). Here a shortened session (2 units, the frame in unit 1) runs through the dump on the
tiny checkpoint, and the arrays the comparison relies on must agree with each other: the KV lengths are
the cumulative unit spans, every unit reads one decision at its last audio row, every decode row is
aligned with the id fed after it, and the rows fed are the encoders' outputs. The streaming mel front end's
bookkeeping (first-unit padding, the 80-sample carry, 2 context frames each side) is checked against the
whole-buffer mel it must slice.
"""

from __future__ import annotations

import numpy as np
import pytest

from services.common.checkpoint import SPECIAL_TOKEN_IDS
from services.thinker.__main__ import main as thinker_main
from services.thinker.duplex_policy import CHUNK_EOS, LISTEN, UNIT_TERMINATORS
from services.thinker.processor.duplex_audio import DuplexAudioStream, buffer_log_mel

UNITS = 2
UNIT_OPEN = SPECIAL_TOKEN_IDS["<unit>"]
UNIT_CLOSE = SPECIAL_TOKEN_IDS["</unit>"]
UNK = SPECIAL_TOKEN_IDS["<unk>"]


def _inputs(path) -> None:  # noqa: ANN001
    rng = np.random.default_rng(3)
    t = np.arange(UNITS * 16_000) / 16_000
    audio = (0.3 * np.sin(2 * np.pi * (220 + 180 * t) * t) + 0.02 * rng.standard_normal(t.shape)).astype(
        np.float32
    )
    ref = (0.1 * rng.standard_normal(32_000)).astype(np.float32)
    frame = rng.integers(0, 256, (448, 896, 3), dtype=np.uint8)
    np.savez(
        path,
        **{
            "duplex.inputs.audio_16k": audio,
            "duplex.inputs.ref_audio_16k": ref,
            "duplex.inputs.frame_rgb": frame,
        },
    )


@pytest.fixture(scope="module")
def dump(tiny_ckpt, tmp_path_factory):  # noqa: ANN001, ANN201
    tmp = tmp_path_factory.mktemp("duplex_dump")
    ref, out = tmp / "inputs.npz", tmp / "dump.npz"
    _inputs(ref)
    args = ["dump", "--duplex", "--checkpoint", str(tiny_ckpt), "--inputs", str(ref), "--out", str(out)]
    assert thinker_main([*args, "--units", str(UNITS), "--frame-unit", "1"]) == 0
    with np.load(out) as z:
        return {k: z[k] for k in z.files}


def test_kv_lengths_are_the_cumulative_unit_spans(dump) -> None:  # noqa: ANN001
    kv, spans, ids = dump["duplex.kv_len"], dump["duplex.unit_spans"], dump["duplex.session_input_ids"]
    assert kv.shape == (UNITS + 1,) and spans.shape == (UNITS, 2)
    assert kv[0] == dump["duplex.prefix.input_ids"].shape[0]
    assert spans[:, 0].tolist() == kv[:-1].tolist() and spans[:, 1].tolist() == kv[1:].tolist()
    assert ids.shape == (kv[-1],) and dump["duplex.session_hidden"].shape == (kv[-1], 128)
    assert np.isfinite(dump["duplex.session_hidden"]).all()
    for k, (s, e) in enumerate(spans):
        unit = dump[f"duplex.u{k}.input_ids"]
        np.testing.assert_array_equal(unit, ids[s:e])
        assert unit[0] == UNIT_OPEN and unit[-1] == UNIT_CLOSE and unit[-2] in UNIT_TERMINATORS
    assert dump["duplex.whisper_kv_len"].tolist() == [50 * (k + 1) for k in range(UNITS)]


def test_one_decision_per_unit_read_at_the_last_audio_row(dump) -> None:  # noqa: ANN001
    ids, hidden = dump["duplex.session_input_ids"], dump["duplex.session_hidden"]
    decisions = dump["duplex.decisions"]
    assert decisions.shape == (UNITS,) and decisions[0] == LISTEN  # unit 0 is forced to listen
    assert dump["duplex.is_listen"].tolist()[0] and dump["duplex.u0.decode_ids"].shape == (0,)
    for k, (s, _e) in enumerate(dump["duplex.unit_spans"]):
        ((a0, a1),) = dump[f"duplex.u{k}.audio_bounds"]
        assert a1 - a0 == 10 and (ids[s + a0 : s + a1] == UNK).all()
        drow = s + a1 - 1
        assert decisions[k] == ids[drow + 1]
        np.testing.assert_array_equal(dump[f"duplex.u{k}.decision_hidden"], hidden[drow])
        logits = dump[f"duplex.u{k}.decision_logits"]
        assert logits.shape == (151748,)
        rows = dump[f"duplex.u{k}.decode_rows"]
        if k >= 1:
            assert rows[0] == drow and dump[f"duplex.u{k}.decode_raw_argmax"][0] == int(np.argmax(logits))


def test_decode_rows_are_aligned_with_the_ids_fed_after_them(dump) -> None:  # noqa: ANN001
    ids = dump["duplex.session_input_ids"]
    for k, (_s, e) in enumerate(dump["duplex.unit_spans"]):
        dec, rows = dump[f"duplex.u{k}.decode_ids"], dump[f"duplex.u{k}.decode_rows"]
        margins = dump[f"duplex.u{k}.decode_margins"]
        assert dec.shape == rows.shape == margins.shape == dump[f"duplex.u{k}.decode_raw_argmax"].shape
        assert len(dec) <= 19 and (margins >= 0).all()
        if not len(dec):
            continue
        assert np.diff(rows).tolist() == [1] * (len(rows) - 1)
        # every decoded id is the next row fed (a <|listen|> after speech would be fed as <|tts_bos|>)
        np.testing.assert_array_equal(ids[rows + 1], dec)
        if len(dec) == 19 and dec[-1] not in UNIT_TERMINATORS:
            assert ids[rows[-1] + 2] == CHUNK_EOS and rows[-1] + 4 == e  # forced terminator, </unit>
        else:
            assert dec[-1] in UNIT_TERMINATORS and rows[-1] + 3 == e


def test_fed_rows_are_the_encoder_outputs(dump) -> None:  # noqa: ANN001
    emb = dump["duplex.session_inputs_embeds"]
    ((p0, p1),) = dump["duplex.prefix.audio_bounds"]
    np.testing.assert_array_equal(emb[p0:p1], dump["duplex.prefix.ref_audio_embeds"])
    assert dump["duplex.prefix.ref_audio_features"].shape[:2] == (1, 80)
    for k, (s, _e) in enumerate(dump["duplex.unit_spans"]):
        ((a0, a1),) = dump[f"duplex.u{k}.audio_bounds"]
        np.testing.assert_array_equal(emb[s + a0 : s + a1], dump[f"duplex.u{k}.audio_embeds"])
        assert dump[f"duplex.u{k}.audio_features"].shape == (1, 80, 102 if k == 0 else 104)
    ((i0, i1),) = dump["duplex.u1.image_bounds"]
    s1 = dump["duplex.unit_spans"][1, 0]
    np.testing.assert_array_equal(emb[s1 + i0 : s1 + i1], dump["duplex.u1.vision_embeds"][0])
    assert dump["duplex.u1.tgt_sizes"].tolist() == [[23, 45]]
    assert dump["duplex.u1.pixel_values.0"].shape == (3, 14, 14490)


class _HostGraph:
    """Stands in for CUDA graph capture on the CPU: a replay re-runs the body into the static outputs."""

    def __call__(self, runner, body):  # noqa: ANN001, ANN204 (ModelRunner.graph_capture)
        outputs = body()

        def replay() -> None:
            for static, fresh in zip(outputs, body(), strict=True):
                static.copy_(fresh)

        return replay, outputs


def test_graph_replays_record_the_same_session(tiny_ckpt, dump, tmp_path) -> None:  # noqa: ANN001
    """The GPU path's taps: with the row-graph step path (emulated on the host) the dump records the same
    rows, hidden states and decisions, although a replay's output buffers are reused by the next one."""
    from services.thinker.duplex_dump import build_backend_for_dump, run_session, to_arrays

    inputs = tmp_path / "inputs.npz"
    _inputs(inputs)
    with np.load(inputs) as z:
        media = {k: z[k] for k in z.files}
    backend = build_backend_for_dump(str(tiny_ckpt), "cpu", "float32", cuda_graphs=False)
    runner = backend.engine.runner
    runner.use_cuda_graphs, runner.graph_capture = True, _HostGraph()
    assert runner.warmup_graphs(2, 1024) > 0
    rec = run_session(
        backend,
        media["duplex.inputs.audio_16k"],
        media["duplex.inputs.ref_audio_16k"],
        media["duplex.inputs.frame_rgb"],
        units=UNITS,
        frame_unit=1,
    )
    backend.executor.shutdown(wait=False)
    graphed = to_arrays(rec, media)
    assert runner.step_counts["graph"] > 0 and runner.step_counts["graph_mixed"] > 0
    for key, ref in dump.items():
        if ref.dtype.kind in "iub":
            np.testing.assert_array_equal(graphed[key], ref, err_msg=key)
        elif key.startswith("duplex."):
            np.testing.assert_allclose(graphed[key], ref, atol=1e-4, rtol=1e-4, err_msg=key)


def test_streaming_mel_slices_the_whole_buffer_with_the_first_unit_carry() -> None:
    """The incremental stream equals upstream's literal recipe: the whole buffer's mel, sliced."""
    rng = np.random.default_rng(0)
    units = 31  # the buffer reaches 30 s in unit 29 and slides by 10 s
    audio = (0.2 * rng.standard_normal(units * 16_000)).astype(np.float32)
    audio[85_000:90_000] = 0.0  # silent frames inside unit 5 (the first whose buffer holds >= 5 s)
    stream = DuplexAudioStream()
    buffer, base = np.zeros(0, np.float32), 0
    for k in range(units):
        chunk = stream.push(audio[16_000 * k : 16_000 * (k + 1)])
        assert chunk is not None and chunk.core.shape[1] == 100
        assert (chunk.prefix_frames, chunk.suffix_frames) == ((0, 2) if k == 0 else (2, 2))
        # the mel sees zeros(560) ++ audio: 16480 samples after the first unit, 16000 more per unit
        buffer = np.concatenate([buffer, audio[max(0, 16_000 * k - 80) : 16_000 * k + 15_920]])
        if k == 0:
            buffer = np.concatenate([np.zeros(560, np.float32), buffer])
        if buffer.shape[0] >= 480_000:
            buffer, base = buffer[160_000:], base + 1000
        if k in (0, 1, 4, 5, 28, 29, 30):
            full = buffer_log_mel(buffer)
            lo = max(0, 100 * k - 2) - base
            np.testing.assert_array_equal(chunk.mel.numpy(), full[:, lo : 100 * k + 102 - base].numpy())
        if k == 5:  # from 5 s on the floor is the buffer's max - 8: silent frames read above the fixed floor
            assert float(chunk.mel.min()) > (-10.0 + 4.0) / 4.0
