"""Thinker processor on the tiny checkpoint's tokenizer: template, token-count contracts, typed errors."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from services.common.checkpoint import SPECIAL_TOKEN_IDS as IDS
from services.common.errors import INVALID_ARGUMENT, UNSUPPORTED_MEDIA
from services.thinker.errors import ProcessorError
from services.thinker.processor import (
    AudioClip,
    AudioInput,
    ImageInput,
    ProcessorLimits,
    ThinkerProcessor,
    VideoInput,
    speech_system_message,
)
from services.thinker.processor.audio import audio_embed_count, log_mel
from services.thinker.processor.chat import normalize_messages, render_chat
from services.thinker.processor.duplex_layout import duplex_session_prefix, duplex_unit_layout
from services.thinker.processor.image import best_resize, choose_grid

UNK = IDS["<unk>"]


@pytest.fixture(scope="module")
def proc(tiny_ckpt) -> ThinkerProcessor:
    return ThinkerProcessor.from_checkpoint(tiny_ckpt)


def _png(w: int, h: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def _wav(seconds: float, rate: int = 16_000) -> bytes:
    import soundfile

    buf = io.BytesIO()
    t = np.arange(int(rate * seconds)) / rate
    soundfile.write(buf, (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32), rate, format="WAV")
    return buf.getvalue()


def _tone(seconds: float) -> np.ndarray:
    t = np.arange(int(16_000 * seconds)) / 16_000
    return (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)


# ----------------------------------------------------------------------------------- chat template
def _render(msgs, **kw) -> str:
    return render_chat(normalize_messages(msgs), **kw)


def test_template_user_turn_thinking_off_has_empty_think_block():
    assert _render([{"role": "user", "content": "hi"}]) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


def test_template_thinking_on_and_tts_suffix_and_system():
    text = _render(
        [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}],
        enable_thinking=True,
        use_tts_template=True,
    )
    assert (
        text
        == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<|tts_bos|>"
    )
    assert _render([{"role": "user", "content": "hi"}], use_tts_template=True).endswith(
        "</think>\n\n<|tts_bos|>"
    )


def test_template_history_drops_old_reasoning_and_keeps_final_assistant_think():
    history = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "<think>\nold\n</think>\n\nA1"},
        {"role": "user", "content": "b"},
    ]
    assert _render(history, add_generation_prompt=False) == (
        "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\nA1<|im_end|>\n<|im_start|>user\nb<|im_end|>\n"
    )
    prefill = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "<think>\nr\n</think>\n\nok"},
    ]
    assert _render(prefill, add_generation_prompt=False).endswith(
        "<|im_start|>assistant\n<think>\nr\n</think>\n\nok<|im_end|>\n"
    )


def test_content_parts_are_joined_with_newlines(proc):
    p = proc([{"role": "user", "content": ["first", "second"]}])
    assert "first\nsecond<|im_end|>" in p.prompt_text
    assert p.input_ids.tolist() == proc.encode_text(p.prompt_text)


def test_speech_system_message_structure():
    msg = speech_system_message(_tone(1.0), mode="audio_assistant")
    assert msg.role == "system" and len(msg.content) == 3
    assert msg.content[0] == "Use the voice in the audio prompt to synthesize new content."
    assert isinstance(msg.content[1], AudioInput)
    assert msg.content[2] == "You are a helpful assistant with the above voice style."
    with pytest.raises(ProcessorError):
        speech_system_message(None, mode="voice_cloning")
    with pytest.raises(ProcessorError):
        speech_system_message(None, mode="nope")


def test_reference_voice_prompt_switches_tts_template_on(proc):
    p = proc([speech_system_message(_tone(2.0)), {"role": "user", "content": "Say hello."}])
    assert p.input_ids[-1].item() == IDS["<|tts_bos|>"]
    assert p.prompt_text.startswith(
        "<|im_start|>system\nUse the voice in the audio prompt to synthesize new content.\n<|audio_start|>"
    )
    assert p.audio_bounds.tolist() == [[p.audio_bounds[0, 0].item(), p.audio_bounds[0, 0].item() + 20]]


# ------------------------------------------------------------------------------ count contracts
def test_image_896x448_expands_to_overview_plus_2x1_grid(proc):
    p = proc([{"role": "user", "content": [ImageInput(_png(896, 448)), "What is shown?"]}])
    assert p.tgt_sizes.tolist() == [[23, 45], [32, 32], [32, 32]]
    assert [tuple(pv.shape) for pv in p.pixel_values] == [
        (3, 14, 14 * 23 * 45),
        (3, 14, 14 * 1024),
        (3, 14, 14 * 1024),
    ]
    assert p.image_bounds.shape == (3, 2) and all(e - s == 64 for s, e in p.image_bounds.tolist())
    assert int((p.input_ids == UNK).sum()) == 3 * 64
    ids = p.input_ids.tolist()
    start = ids.index(IDS["<image_id>"])
    assert ids[start + 2] == IDS["</image_id>"] and ids[start + 3] == IDS["<image>"]
    assert ids.count(IDS["<slice>"]) == 2 and ids.count(IDS["</slice>"]) == 2


def test_grid_choice_and_resize_rules():
    assert choose_grid((448, 448), 9, 448) is None
    assert choose_grid((896, 448), 9, 448) == (2, 1)
    assert choose_grid((448, 1344), 9, 448) == (1, 3)
    assert choose_grid((4000, 3000), 9, 448) == (3, 3)
    assert choose_grid((4000, 3000), 1, 448) is None
    assert best_resize((896, 448), 448, 14, False) == (630, 322)
    assert best_resize((100, 50), 448, 14, True) == (630, 322)


def test_audio_3_2_s_gives_32_placeholders_and_320_mel_frames(proc):
    p = proc([{"role": "user", "content": [AudioInput(_tone(3.2)), "Answer."]}])
    assert p.audio_features.shape == (1, 80, 320) and p.audio_feature_lens.tolist() == [320]
    ((s, e),) = p.audio_bounds.tolist()
    assert (
        e - s == 32
        and p.input_ids[s - 1] == IDS["<|audio_start|>"]
        and p.input_ids[e] == IDS["<|audio_end|>"]
    )
    assert int((p.input_ids == UNK).sum()) == 32
    assert p.input_ids[-1].item() == IDS["<|tts_bos|>"]  # audio switches the TTS template on


def test_audio_per_second_placeholder_groups(proc):
    p = proc([{"role": "user", "content": [AudioInput(_tone(2.5))]}], audio_chunked_placeholders=True)
    assert [e - s for s, e in p.audio_bounds.tolist()] == [10, 10, 5]


def test_long_audio_is_cut_into_30_s_pieces():
    wave = _tone(40.0)
    assert audio_embed_count(len(wave), 5) == 400
    assert log_mel(wave[:480_000]).shape == (80, 3000)


def test_resampled_and_encoded_audio_give_the_same_counts(proc):
    a = proc([{"role": "user", "content": [AudioInput(_wav(2.0, 24_000))]}])
    b = proc([{"role": "user", "content": [AudioInput(AudioClip(_tone(2.0), 16_000))]}])
    assert a.audio_bounds.tolist() == b.audio_bounds.tolist() and int((a.input_ids == UNK).sum()) == 20


def test_one_video_frame_is_66_tokens(proc):
    base = proc([{"role": "user", "content": ["describe"]}])
    p = proc([{"role": "user", "content": [VideoInput(frames=(_png(640, 360),)), "describe"]}])
    extra = p.num_tokens - base.num_tokens
    assert extra == 66 + 1  # <image> + 64 + </image>, plus the newline joining it to the text
    assert p.image_bounds.shape == (1, 2) and p.tgt_sizes.shape == (1, 2)
    assert IDS["<image_id>"] not in p.input_ids.tolist()
    three = proc([{"role": "user", "content": [VideoInput(frames=(_png(64, 64),) * 3)]}])
    assert three.image_bounds.shape == (3, 2) and int((three.input_ids == UNK).sum()) == 192


# --------------------------------------------------------------------------------- typed errors
def test_limits_raise_typed_errors(tiny_ckpt):
    proc = ThinkerProcessor.from_checkpoint(
        tiny_ckpt, limits=ProcessorLimits(max_images=1, max_audios=1, max_video_frames=2, max_audio_seconds=3)
    )
    img = ImageInput(_png(32, 32))
    cases = [
        [img, img],
        [AudioInput(_tone(1.0)), AudioInput(_tone(1.0))],
        [VideoInput(frames=(_png(32, 32),) * 3)],
        [AudioInput(_tone(4.0))],
    ]
    for content in cases:
        with pytest.raises(ProcessorError) as info:
            proc([{"role": "user", "content": content}])
        assert (
            info.value.code == INVALID_ARGUMENT
            and "limit" in info.value.message
            or "exceeds" in info.value.message
        )


def test_corrupt_media_raise_unsupported_media(proc):
    bad = [
        ImageInput(b"\x89PNG\r\n\x1a\nnot really a png"),
        ImageInput(b""),
        AudioInput(b"RIFF....WAVEfmt garbage"),
        AudioInput(np.zeros(10, dtype=np.float32)),
        AudioInput(np.array([0.0, np.nan] * 2000, dtype=np.float32)),
        VideoInput(frames=(b"nope",)),
    ]
    for part in bad:
        with pytest.raises(ProcessorError) as info:
            proc([{"role": "user", "content": [part, "x"]}])
        assert info.value.code == UNSUPPORTED_MEDIA
        assert info.value.param == "messages[0].content[0]" or info.value.param.startswith(
            "messages[0].content[0]"
        )


def test_bad_messages_and_reserved_tokens_are_rejected(proc):
    for msgs in ([], [{"role": "assistant", "content": "x"}], [{"role": "robot", "content": "x"}]):
        with pytest.raises(ProcessorError):
            proc(msgs)
    for text in ("look: <image>./</image>", "<image><unk></image>", "<|audio_start|><unk><|audio_end|>"):
        with pytest.raises(ProcessorError) as info:
            proc([{"role": "user", "content": text}])
        assert info.value.param == "messages"


# ------------------------------------------------------------------------------------- duplex
def test_duplex_unit_layouts(proc):
    audio_only = duplex_unit_layout()
    ids, ib, ab = audio_only.tensors()
    assert ids.tolist() == [IDS["<unit>"]] + [UNK] * 10 and ab.tolist() == [[1, 11]] and ib.numel() == 0
    later = duplex_unit_layout([1], previous_terminator=IDS["<|listen|>"], close_previous_unit=True)
    ids, ib, ab = later.tensors()
    assert ids[:3].tolist() == [IDS["<|listen|>"], IDS["</unit>"], IDS["<unit>"]]
    assert len(ids) == 3 + 66 + 10 and ib.tolist() == [[4, 68]] and ab.tolist() == [[69, 79]]
    # stacked pair, max_slice_nums [2, 1]: the HD frame gets overview + 2 cells, the composite one block
    slices, sizes, counts = proc.process_frames([_png(960, 540), _png(960, 540)], [2, 1])
    assert counts == [3, 1] and len(slices) == 4 and sizes.shape == (4, 2)
    pair = duplex_unit_layout(counts, audio_rows=0)
    assert len(pair.input_ids) - 1 == 4 * 64 + 8 == 264  # 4 blocks of 64 + their framing tokens
    assert len(pair.image_bounds) == 4


def test_duplex_session_prefix(proc):
    plain = duplex_session_prefix(proc.encode_text)
    assert (
        proc.tokenizer.decode(plain.input_ids) == "<|im_start|>system\nStreaming Omni Conversation.<|im_end|>"
    )
    voiced = duplex_session_prefix(proc.encode_text, instructions="Be brief.", ref_audio_rows=20)
    ids, _, ab = voiced.tensors()
    ((s, e),) = ab.tolist()
    assert (
        e - s == 20 and ids[s - 1].item() == IDS["<|audio_start|>"] and ids[e].item() == IDS["<|audio_end|>"]
    )
    assert ids[-1].item() == IDS["<|im_end|>"]


def test_process_audio_helper_counts_rows(proc):
    feats, lens, count = proc.process_audio(_tone(6.0))
    assert feats.shape == (1, 80, 600) and lens.tolist() == [600] and count == 60
    assert torch.isfinite(feats).all()


def test_streaming_mel_units_equal_offline_frames():
    from services.thinker.processor.audio import N_FFT, PIECE_SAMPLES, StreamingLogMel, _mel_filters

    rng = np.random.default_rng(7)
    wave = (0.2 * rng.standard_normal(int(16_000 * 3.3))).astype(np.float32)
    stream = StreamingLogMel(dynamic_after_s=float("inf"))
    units = []
    pos = 0
    for size in (5000, 11000, 16000, 3000, 17800):
        units += stream.push(wave[pos : pos + size])
        pos += size
    assert pos == len(wave) and len(units) == 3
    assert all(u.mel.shape == (80, 100) and u.lookahead.shape == (80, 2) for u in units)
    tail = stream.flush()
    assert tail is not None and tail.mel.shape == (80, 30) and tail.lookahead is None
    padded = torch.zeros(PIECE_SAMPLES)
    padded[: len(wave)] = torch.from_numpy(wave)
    spec = torch.stft(
        padded, n_fft=N_FFT, hop_length=160, window=torch.hann_window(N_FFT), return_complex=True
    )
    offline = (torch.clamp(_mel_filters() @ spec[:, :-1].abs() ** 2, min=1e-10).log10() + 4) / 4
    streamed = torch.cat([u.mel for u in units] + [tail.mel], dim=1)
    torch.testing.assert_close(streamed, offline[:, :330], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(units[0].lookahead, offline[:, 100:102], rtol=1e-5, atol=1e-5)
