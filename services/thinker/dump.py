"""Fidelity dump: ``python -m services.thinker dump --checkpoint DIR --out FILE.npz``.

Regenerates the three oracle prompts (text; text + 896x448 image; text + 3.2 s audio, user turns,
thinking off, the audio prompt with the TTS template) through this project's processor and model, and
writes the arrays under the reference's key names (docs/fidelity.md, Dump keys), so the two files can be
diffed against the upstream reference. ``--inputs REF.npz`` takes only the two raw media arrays
(``inputs.image_rgb``, ``inputs.audio_16k``) from a reference file; without it the dump synthesises its own
image and audio (same shapes), which is enough for shape checks but not for a numeric comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Sequence

import numpy as np
import torch

TEXT_PROMPT = "Please describe, in one short sentence, what a numerical oracle is."
IMAGE_PROMPT = "What is shown in this picture?"
AUDIO_PROMPT = "Please answer the question in the audio."
IMAGE_WH = (896, 448)
AUDIO_SAMPLES = 51_200  # 3.2 s at 16 kHz


def synthetic_image(seed: int = 0) -> np.ndarray:
    """A deterministic 448x896 RGB test card (gradients + blocks + noise), uint8."""
    rng = np.random.default_rng(seed)
    w, h = IMAGE_WH
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    img = np.stack([255 * x / w, 255 * y / h, 128 + 100 * np.sin(x / 37.0) * np.cos(y / 23.0)], -1)
    for _ in range(5):
        x0, y0 = int(rng.integers(0, w - 120)), int(rng.integers(0, h - 120))
        img[y0 : y0 + 100, x0 : x0 + 100] = rng.uniform(0, 255, 3)
    img += rng.normal(0, 4, img.shape)
    return np.clip(img, 0, 255).astype(np.uint8)


def synthetic_audio(seed: int = 0) -> np.ndarray:
    """A deterministic 3.2 s 16 kHz float32 signal: a sweep plus a tremolo tone and light noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(AUDIO_SAMPLES, dtype=np.float64) / 16_000
    s = 0.5 * np.sin(2 * np.pi * (300 * t + 200 * t**2)) + 0.25 * np.sin(2 * np.pi * 660 * t) * np.sin(
        np.pi * t
    )
    s += 0.01 * rng.standard_normal(AUDIO_SAMPLES)
    return (0.45 * s / np.abs(s).max()).astype(np.float32)


def _f32(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu", torch.float32).numpy()


def _i64(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu", torch.int64).numpy()


def _greedy_margins(model: object, embeds: torch.Tensor, greedy: list[int]) -> np.ndarray:
    """Top-1 minus top-2 logit of every greedy step, from one teacher-forced pass (no cache)."""
    with torch.inference_mode():
        tail = model.embed_tokens(torch.tensor(greedy[:-1], device=model.device))  # type: ignore[attr-defined]
        seq = torch.cat([embeds, tail], 0)[None]
        positions = torch.arange(seq.shape[1], device=seq.device)[None]
        logits = model.llm(inputs_embeds=seq, position_ids=positions, use_cache=False).logits[0]  # type: ignore[attr-defined]
        top2 = logits[embeds.shape[0] - 1 :].float().topk(2, dim=-1).values
    return _f32(top2[:, 0] - top2[:, 1])


def build_dump(
    checkpoint: str,
    *,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    image_rgb: np.ndarray | None = None,
    audio_16k: np.ndarray | None = None,
    greedy_steps: int = 8,
) -> dict[str, np.ndarray]:
    """Every array of the dump, keyed as in docs/fidelity.md, Dump keys (plus ``meta_json``)."""
    from services.common.checkpoint import Checkpoint
    from services.thinker.model import ThinkerModel
    from services.thinker.processor import AudioInput, ImageInput, ThinkerProcessor

    ckpt = Checkpoint(checkpoint)
    t0 = time.time()
    model = ThinkerModel.from_checkpoint(ckpt, dtype=dtype, device=device)
    processor = ThinkerProcessor.from_checkpoint(ckpt)
    image = synthetic_image() if image_rgb is None else np.asarray(image_rgb, dtype=np.uint8)
    audio = synthetic_audio() if audio_16k is None else np.asarray(audio_16k, dtype=np.float32)
    prompts = {
        "text": [TEXT_PROMPT],
        "image": [ImageInput(image), IMAGE_PROMPT],
        "audio": [AudioInput(audio), AUDIO_PROMPT],
    }
    out: dict[str, np.ndarray] = {"inputs.image_rgb": image, "inputs.audio_16k": audio}
    meta: dict[str, object] = {
        "checkpoint": str(ckpt.root),
        "dtype": str(dtype),
        "device": device,
        "prompts": {},
    }
    for name, content in prompts.items():
        processed = processor([{"role": "user", "content": content}])
        p = f"thinker.{name}."
        with torch.inference_mode():
            embeds = model.embed_prompt(processed)
            hidden, logits = model.forward_hidden(embeds)
        out[p + "input_ids"] = _i64(processed.input_ids)
        out[p + "inputs_embeds"] = _f32(embeds)
        out[p + "hidden"] = _f32(hidden)
        out[p + "logits_last"] = _f32(logits)
        if greedy_steps > 0:
            greedy = model.greedy_no_cache(embeds, greedy_steps)
            out[p + "greedy_ids"] = np.asarray(greedy, dtype=np.int64)
            out[p + "greedy_margins"] = _greedy_margins(model, embeds, greedy)
        if name == "image":
            for i, pv in enumerate(processed.pixel_values):
                out[p + f"pixel_values.{i}"] = _f32(pv)
            out[p + "tgt_sizes"] = _i64(processed.tgt_sizes)
            out[p + "image_bound"] = _i64(processed.image_bounds)
            out[p + "vision_embeds"] = _f32(
                model.get_vision_embeds(processed.pixel_values, processed.tgt_sizes)
            )
        if name == "audio":
            out[p + "audio_features"] = _f32(processed.audio_features)
            out[p + "audio_feature_lens"] = _i64(processed.audio_feature_lens)
            out[p + "audio_bounds"] = _i64(processed.audio_bounds)
            rows = model.get_audio_embeds(processed.audio_features, processed.audio_feature_lens, 1.0)
            out[p + "audio_embeds"] = _f32(torch.cat(rows, 0))
        meta["prompts"][name] = {"prompt_text": processed.prompt_text, "seq_len": processed.num_tokens}  # type: ignore[index]
    meta["seconds"] = round(time.time() - t0, 2)
    out["meta_json"] = np.asarray(json.dumps(meta, ensure_ascii=False))
    return out


def dump_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """The options every thinker dump takes (``dump`` and ``dump --duplex``)."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--checkpoint", required=True, help="MiniCPM-o 4.5 checkpoint directory")
    parser.add_argument("--out", required=True, help="output .npz")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: leave the default)")
    return parser


def apply_threads(threads: int) -> None:
    """One OpenBLAS thread (spin-waiting starves torch on small hosts) and ``threads`` torch threads."""
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    if threads > 0:
        torch.set_num_threads(threads)


def main(argv: Sequence[str] | None = None) -> int:
    parser = dump_parser("python -m services.thinker dump", __doc__.splitlines()[0])
    parser.add_argument("--inputs", help="reference .npz to take inputs.image_rgb / inputs.audio_16k from")
    parser.add_argument(
        "--greedy-steps", type=int, default=8, help="no-cache greedy ids per prompt (0: skip)"
    )
    args = parser.parse_args(argv)
    apply_threads(args.threads)
    image = audio = None
    if args.inputs:
        with np.load(args.inputs) as ref:
            image, audio = ref["inputs.image_rgb"], ref["inputs.audio_16k"]
    arrays = build_dump(
        args.checkpoint,
        dtype=getattr(torch, args.dtype),
        device=args.device,
        image_rgb=image,
        audio_16k=audio,
        greedy_steps=args.greedy_steps,
    )
    np.savez(args.out, **arrays)
    print(f"wrote {len(arrays)} arrays to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
