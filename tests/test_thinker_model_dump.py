"""The thinker fidelity dump writes the reference's keys (docs/fidelity.md, Dump keys) with the expected
shapes (tiny checkpoint).

The numeric comparison against the upstream reference needs the upstream code and runs outside CI
(see the closing notes of issue 3); here we check the contract the comparison relies on.
"""

from __future__ import annotations

import numpy as np

from services.thinker.__main__ import main as thinker_main


def test_dump_writes_every_oracle_key_with_oracle_shapes(tiny_ckpt, tmp_path):
    out = tmp_path / "thinker.npz"
    assert (
        thinker_main(["dump", "--checkpoint", str(tiny_ckpt), "--out", str(out), "--greedy-steps", "2"]) == 0
    )
    z = np.load(out)
    hidden = 128  # tiny checkpoint LLM width
    for prompt in ("text", "image", "audio"):
        ids = z[f"thinker.{prompt}.input_ids"]
        assert ids.dtype == np.int64 and ids.ndim == 1
        n = ids.shape[0]
        assert z[f"thinker.{prompt}.inputs_embeds"].shape == (n, hidden)
        assert z[f"thinker.{prompt}.hidden"].shape == (n, hidden)
        assert z[f"thinker.{prompt}.logits_last"].shape == (151748,)
        greedy = z[f"thinker.{prompt}.greedy_ids"]
        assert greedy.shape == (2,) and greedy[0] == int(np.argmax(z[f"thinker.{prompt}.logits_last"]))
    assert z["thinker.image.tgt_sizes"].tolist() == [[23, 45], [32, 32], [32, 32]]
    assert [z[f"thinker.image.pixel_values.{i}"].shape for i in range(3)] == [
        (3, 14, 14490),
        (3, 14, 14336),
        (3, 14, 14336),
    ]
    assert z["thinker.image.image_bound"].shape == (3, 2)
    assert z["thinker.image.vision_embeds"].shape == (3, 64, hidden)
    assert z["thinker.audio.audio_features"].shape == (1, 80, 320)
    assert z["thinker.audio.audio_feature_lens"].tolist() == [320]
    ((s, e),) = z["thinker.audio.audio_bounds"].tolist()
    assert e - s == 32 and z["thinker.audio.audio_embeds"].shape == (32, hidden)
    # the merged rows are the encoder outputs
    np.testing.assert_array_equal(z["thinker.audio.inputs_embeds"][s:e], z["thinker.audio.audio_embeds"])
    (s0, e0) = z["thinker.image.image_bound"][0]
    np.testing.assert_array_equal(
        z["thinker.image.inputs_embeds"][s0:e0], z["thinker.image.vision_embeds"][0]
    )


def test_dump_takes_media_from_an_inputs_file(tiny_ckpt, tmp_path):
    rng = np.random.default_rng(5)
    ref = tmp_path / "inputs.npz"
    image = rng.integers(0, 256, (448, 896, 3), dtype=np.uint8)
    audio = (0.1 * rng.standard_normal(51_200)).astype(np.float32)
    np.savez(ref, **{"inputs.image_rgb": image, "inputs.audio_16k": audio})
    out = tmp_path / "d.npz"
    args = [
        "dump",
        "--checkpoint",
        str(tiny_ckpt),
        "--out",
        str(out),
        "--inputs",
        str(ref),
        "--greedy-steps",
        "0",
    ]
    assert thinker_main(args) == 0
    z = np.load(out)
    np.testing.assert_array_equal(z["inputs.image_rgb"], image)
    np.testing.assert_array_equal(z["inputs.audio_16k"], audio)
    assert "thinker.text.greedy_ids" not in z.files
