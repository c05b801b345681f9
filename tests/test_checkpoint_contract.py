"""The checkpoint contract on the generated tiny checkpoint: per-stage loading, and one specific error per
kind of violation (each test corrupts a symlinked copy of the session's ``tiny_ckpt``)."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.common.checkpoint import (
    CODEC_EOS_ID,
    SPECIAL_TOKEN_IDS,
    STAGE_PREFIXES,
    Checkpoint,
    CheckpointError,
)
from services.common.checkpoint_tool.check import check_checkpoint

SHARD2 = "model-00002-of-00002.safetensors"


def linked_copy(src: Path, dst: Path, skip: Iterable[str] = ()) -> Path:
    """Mirror ``src`` into ``dst`` with one symlink per file, leaving out the relative paths in ``skip``
    (the test then writes its corrupted version of those)."""
    skipped = set(skip)
    for path in src.rglob("*"):
        rel = path.relative_to(src)
        if path.is_dir():
            (dst / rel).mkdir(parents=True, exist_ok=True)
        elif str(rel) not in skipped:
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            os.symlink(path.resolve(), dst / rel)
    return dst


def _rewrite_json(src: Path, dst: Path, name: str, edit) -> None:
    data = json.loads((src / name).read_text())
    edit(data)
    (dst / name).write_text(json.dumps(data))


# ------------------------------------------------------------------------------------ per-stage loading
def test_thinker_loads_only_its_prefixes_with_config_dims(tiny_ckpt: Path) -> None:
    ckpt = Checkpoint(tiny_ckpt)
    tensors = ckpt.load_stage_tensors("thinker")
    assert tensors and all(k.startswith(STAGE_PREFIXES["thinker"]) for k in tensors)
    for prefix in STAGE_PREFIXES["thinker"]:
        assert any(k.startswith(prefix) for k in tensors), prefix
    cfg = ckpt.config
    hidden = cfg["hidden_size"]
    Checkpoint.expect_shape(tensors, "llm.model.embed_tokens.weight", (cfg["vocab_size"], hidden))
    Checkpoint.expect_shape(tensors, "llm.lm_head.weight", (cfg["vocab_size"], hidden))
    Checkpoint.expect_shape(tensors, "resampler.query", (cfg["query_num"], hidden))
    Checkpoint.expect_shape(
        tensors,
        "audio_projection_layer.linear1.weight",
        (hidden, cfg["audio_config"]["encoder_ffn_dim"] // 4),
    )
    Checkpoint.expect_shape(
        tensors,
        "vpm.embeddings.position_embedding.weight",
        ((980 // 14) ** 2, cfg["vision_config"]["hidden_size"]),
    )
    llm_layers = {int(m.group(1)) for k in tensors if (m := re.match(r"llm\.model\.layers\.(\d+)\.", k))}
    assert llm_layers == set(range(cfg["num_hidden_layers"]))
    vpm_layers = {int(m.group(1)) for k in tensors if (m := re.match(r"vpm\.encoder\.layers\.(\d+)\.", k))}
    assert vpm_layers == set(range(cfg["vision_config"]["num_hidden_layers"] - 1))  # last one dropped
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())


def test_talker_loads_only_tts_with_real_vocabularies(tiny_ckpt: Path) -> None:
    ckpt = Checkpoint(tiny_ckpt)
    tensors = ckpt.load_stage_tensors("talker", dtype=torch.float32)
    assert tensors and all(k.startswith("tts.") for k in tensors)
    tts = ckpt.tts_config
    assert tts["num_audio_tokens"] == CODEC_EOS_ID + 1 and tts["llm_dim"] == ckpt.config["hidden_size"]
    Checkpoint.expect_shape(tensors, "tts.emb_text.weight", (152064, tts["hidden_size"]))
    Checkpoint.expect_shape(tensors, "tts.emb_code.0.weight", (6562, tts["hidden_size"]))
    Checkpoint.expect_shape(tensors, "tts.model.embed_tokens.weight", (32000, tts["hidden_size"]))
    Checkpoint.expect_shape(tensors, "tts.head_code.0.parametrizations.weight.original0", (6562, 1))
    Checkpoint.expect_shape(
        tensors, "tts.head_code.0.parametrizations.weight.original1", (6562, tts["hidden_size"])
    )
    assert all(t.dtype == torch.float32 for t in tensors.values())


def test_tokenizer_ids_and_assets(tiny_ckpt: Path) -> None:
    ckpt = Checkpoint(tiny_ckpt)
    tok = ckpt.tokenizer()
    assert len(tok) == 151748
    for token, want in SPECIAL_TOKEN_IDS.items():
        assert tok.convert_tokens_to_ids(token) == want
    assert ckpt.generation_config["eos_token_id"] == [151645, 151643]
    assert ckpt.preprocessor_config["image_feature_size"] == ckpt.config["query_num"] == 64
    assert sorted(p.name for p in ckpt.token2wav_dir.iterdir()) == sorted(
        ["flow.yaml", "flow.pt", "hift.pt", "campplus.onnx", "speech_tokenizer_v2_25hz.onnx"]
    )
    assert ckpt.ref_audio_path.is_file()


# ------------------------------------------------------------------------------------------ violations
def test_wrong_version_is_rejected(tiny_ckpt: Path, tmp_path: Path) -> None:
    bad = linked_copy(tiny_ckpt, tmp_path / "c", skip=["config.json"])
    _rewrite_json(tiny_ckpt, bad, "config.json", lambda c: c.update(version="2.6"))
    with pytest.raises(
        CheckpointError, match=r"config\.json: key 'version' is '2\.6'.*supports only.*'4\.5'"
    ):
        check_checkpoint(bad)


def test_missing_config_key_is_named(tiny_ckpt: Path, tmp_path: Path) -> None:
    bad = linked_copy(tiny_ckpt, tmp_path / "c", skip=["config.json"])
    _rewrite_json(tiny_ckpt, bad, "config.json", lambda c: c["tts_config"].pop("num_audio_tokens"))
    with pytest.raises(CheckpointError, match=r"missing required key tts_config\.num_audio_tokens"):
        check_checkpoint(bad)


def test_missing_shard_is_rejected(tiny_ckpt: Path, tmp_path: Path) -> None:
    bad = linked_copy(tiny_ckpt, tmp_path / "c", skip=[SHARD2])
    with pytest.raises(
        CheckpointError, match=rf"{SHARD2}: shard listed in model\.safetensors\.index\.json is missing"
    ):
        check_checkpoint(bad)


def _rewrite_shard2(src: Path, dst: Path, edit) -> None:
    tensors = load_file(str(src / SHARD2))
    edit(tensors)
    save_file(tensors, str(dst / SHARD2), metadata={"format": "pt"})


def test_missing_tensor_is_named(tiny_ckpt: Path, tmp_path: Path) -> None:
    name = "tts.model.norm.weight"
    bad = linked_copy(tiny_ckpt, tmp_path / "c", skip=[SHARD2, "model.safetensors.index.json"])
    _rewrite_shard2(tiny_ckpt, bad, lambda t: t.pop(name))
    _rewrite_json(tiny_ckpt, bad, "model.safetensors.index.json", lambda i: i["weight_map"].pop(name))
    with pytest.raises(CheckpointError, match=rf"missing tensor '{re.escape(name)}' \(expected shape \[64\]"):
        check_checkpoint(bad)


def test_tensor_listed_but_absent_from_shard_is_named(tiny_ckpt: Path, tmp_path: Path) -> None:
    name = "tts.model.norm.weight"
    bad = linked_copy(tiny_ckpt, tmp_path / "c", skip=[SHARD2])
    _rewrite_shard2(tiny_ckpt, bad, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=rf"{SHARD2}: tensor '{re.escape(name)}' listed in the index"):
        check_checkpoint(bad)


def test_wrong_shape_is_named(tiny_ckpt: Path, tmp_path: Path) -> None:
    name = "tts.projector_semantic.linear1.weight"  # [tts hidden 64, llm_dim 128]
    bad = linked_copy(tiny_ckpt, tmp_path / "c", skip=[SHARD2])
    _rewrite_shard2(tiny_ckpt, bad, lambda t: t.update({name: torch.zeros(64, 96, dtype=torch.bfloat16)}))
    with pytest.raises(
        CheckpointError, match=rf"tensor '{re.escape(name)}' has shape \[64, 96\], expected \[64, 128\]"
    ):
        check_checkpoint(bad)


def test_missing_asset_is_named(tiny_ckpt: Path, tmp_path: Path) -> None:
    bad = linked_copy(tiny_ckpt, tmp_path / "c", skip=["assets/token2wav/campplus.onnx"])
    with pytest.raises(CheckpointError, match=r"assets/token2wav/campplus\.onnx: missing Code2Wav asset"):
        check_checkpoint(bad)
    with pytest.raises(CheckpointError, match=r"campplus\.onnx: missing"):
        _ = Checkpoint(bad).token2wav_dir


def test_missing_reference_audio_is_named(tiny_ckpt: Path, tmp_path: Path) -> None:
    bad = linked_copy(tiny_ckpt, tmp_path / "c", skip=["assets/HT_ref_audio.wav"])
    with pytest.raises(CheckpointError, match=r"HT_ref_audio\.wav: missing default reference voice"):
        check_checkpoint(bad)


def test_bad_special_id_is_named(tiny_ckpt: Path, tmp_path: Path) -> None:
    bad = linked_copy(tiny_ckpt, tmp_path / "c", skip=["tokenizer.json"])

    def rename_tts_bos(tok: dict) -> None:
        entry = next(e for e in tok["added_tokens"] if e["content"] == "<|tts_bos|>")
        entry["content"] = "<|tts_start|>"

    _rewrite_json(tiny_ckpt, bad, "tokenizer.json", rename_tts_bos)
    with pytest.raises(CheckpointError, match=r"special token '<\|tts_bos\|>' has id \d+, expected 151703"):
        check_checkpoint(bad)


def test_flow_yaml_with_unknown_tag_is_rejected(tiny_ckpt: Path, tmp_path: Path) -> None:
    bad = linked_copy(tiny_ckpt, tmp_path / "c", skip=["assets/token2wav/flow.yaml"])
    text = (tiny_ckpt / "assets/token2wav/flow.yaml").read_text()
    (bad / "assets/token2wav/flow.yaml").write_text(
        text.replace("!new:cosyvoice2.flow.decoder_dit.DiT", "!!python/object/apply:os.system")
    )
    with pytest.raises(CheckpointError, match=r"flow\.yaml: does not parse with the safe flow loader"):
        check_checkpoint(bad)


def test_flow_weights_not_matching_yaml_are_named(tiny_ckpt: Path, tmp_path: Path) -> None:
    bad = linked_copy(tiny_ckpt, tmp_path / "c", skip=["assets/token2wav/flow.yaml"])
    text = (tiny_ckpt / "assets/token2wav/flow.yaml").read_text()
    (bad / "assets/token2wav/flow.yaml").write_text(text.replace("depth: 2", "depth: 3"))
    with pytest.raises(CheckpointError, match=r"flow\.pt: missing tensor 'decoder\.estimator\.blocks\.2\."):
        check_checkpoint(bad)


def test_stray_prefix_is_rejected(tiny_ckpt: Path, tmp_path: Path) -> None:
    bad = linked_copy(tiny_ckpt, tmp_path / "c", skip=[SHARD2, "model.safetensors.index.json"])
    _rewrite_shard2(tiny_ckpt, bad, lambda t: t.update({"code2wav.extra.weight": torch.zeros(2)}))
    _rewrite_json(
        tiny_ckpt,
        bad,
        "model.safetensors.index.json",
        lambda i: i["weight_map"].update({"code2wav.extra.weight": SHARD2}),
    )
    with pytest.raises(
        CheckpointError, match=r"tensor 'code2wav\.extra\.weight' is outside the known prefixes"
    ):
        check_checkpoint(bad)


def test_vocab_size_151936_is_accepted_by_the_shape_check(tiny_ckpt: Path, tmp_path: Path) -> None:
    """The real config may say 151,936 rows; shapes then follow the config, and a mismatch names the key."""
    bad = linked_copy(tiny_ckpt, tmp_path / "c", skip=["config.json"])
    _rewrite_json(tiny_ckpt, bad, "config.json", lambda c: c.update(vocab_size=151936))
    with pytest.raises(
        CheckpointError,
        match=r"'llm\.(lm_head|model\.embed_tokens)\.weight' has shape \[151748, 128\], "
        r"expected \[151936, 128\].*vocab_size",
    ):
        check_checkpoint(bad)


def test_hift_with_legacy_weight_norm_names_is_accepted(tiny_ckpt: Path, tmp_path: Path) -> None:
    """Real-world hift.pt files may carry weight_g/weight_v instead of parametrization names."""
    from services.common.checkpoint_tool.check import CheckReport, check_hift

    state = torch.load(str(tiny_ckpt / "assets/token2wav/hift.pt"), map_location="cpu", weights_only=True)
    legacy = {
        k.replace(".parametrizations.weight.original0", ".weight_g")
        .replace(".parametrizations.weight.original1", ".weight_v")
        .removeprefix("generator."): v
        for k, v in state.items()
    }
    torch.save(legacy, tmp_path / "hift.pt")
    report = CheckReport(tmp_path)
    check_hift(tmp_path, report)
    assert "legacy weight_g/weight_v" in report.lines[-1] and "generator." not in report.lines[-1]
    legacy.pop("conv_post.weight_v")
    torch.save(legacy, tmp_path / "hift.pt")
    with pytest.raises(
        CheckpointError, match=r"hift\.pt: missing tensor 'conv_post\.parametrizations\.weight\.original1'"
    ):
        check_hift(tmp_path, report)


def test_checkpoint_with_151936_rows_is_accepted(tiny_ckpt: Path, tmp_path: Path) -> None:
    """A real download may pad the LLM tables to 151,936 rows; consistent config + tensors pass."""
    shard1 = "model-00001-of-00002.safetensors"
    ok = linked_copy(tiny_ckpt, tmp_path / "c", skip=[shard1, "config.json"])
    _rewrite_json(tiny_ckpt, ok, "config.json", lambda c: c.update(vocab_size=151936))
    tensors = load_file(str(tiny_ckpt / shard1))
    for name in ("llm.model.embed_tokens.weight", "llm.lm_head.weight"):
        t = tensors[name]
        tensors[name] = torch.cat([t, torch.zeros(151936 - t.shape[0], t.shape[1], dtype=t.dtype)])
    save_file(tensors, str(ok / shard1), metadata={"format": "pt"})
    report = check_checkpoint(ok, load_assets=False)
    assert any("embed_tokens rows 151936" in line for line in report.lines)
    assert any("151748 entries" in line for line in report.lines)  # tokenizer size read from its own file
