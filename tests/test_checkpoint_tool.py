"""The checkpoint generator: generator -> checker round trip, determinism, the synthesized tokenizer, the
token2wav assets, and the full-size plan (enumerated on the meta device, never materialised here)."""

from __future__ import annotations

import hashlib
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from services.common.checkpoint import Checkpoint, load_tokenizer
from services.common.checkpoint_tool.cli import main
from services.common.checkpoint_tool.config_templates import build_config
from services.common.checkpoint_tool.generate import GENERATOR_VERSION, read_manifest
from services.common.checkpoint_tool.token2wav_assets import s3_state_specs, write_flow
from services.common.checkpoint_tool.tokenizer_synth import write_tokenizer_files
from services.common.checkpoint_tool.weights import (
    TensorSpec,
    all_specs,
    make_tensor,
    plan_shards,
    write_sharded_weights,
)

REPO = Path(__file__).resolve().parents[1]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---------------------------------------------------------------------------------------- round trip
def test_check_accepts_generated_checkpoint(tiny_ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", str(tiny_ckpt)]) == 0
    out = capsys.readouterr().out
    assert "OK: the checkpoint satisfies" in out
    assert "151748 entries" in out and "1 of 2 stored (last dropped)" in out


def test_console_module_reports_failure_with_exit_1(tiny_ckpt: Path, tmp_path: Path) -> None:
    """``python -m services.common.checkpoint_tool check`` exits 1 and prints the reason."""
    (tmp_path / "config.json").write_text(json.dumps({"version": "4.5"}))
    proc = subprocess.run(
        [sys.executable, "-m", "services.common.checkpoint_tool", "check", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1
    assert "FAIL:" in proc.stderr and "generation_config.json: missing" in proc.stderr


def test_make_refuses_to_overwrite_without_force(
    tiny_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "keep.txt").write_text("not a checkpoint")
    assert main(["make", "--size", "tiny", str(tmp_path)]) == 1
    assert main(["make", "--size", "tiny", "--force", str(tmp_path)]) == 1  # no config.json: never deleted
    assert (tmp_path / "keep.txt").is_file()
    assert "refusing to delete" in capsys.readouterr().err


def test_layout_is_complete(tiny_ckpt: Path) -> None:
    for name in (
        "config.json",
        "generation_config.json",
        "preprocessor_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "vocab.json",
        "merges.txt",
        "added_tokens.json",
        "special_tokens_map.json",
        "model.safetensors.index.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "assets/HT_ref_audio.wav",
    ):
        assert (tiny_ckpt / name).is_file(), name
    cfg = json.loads((tiny_ckpt / "config.json").read_text())
    assert cfg["version"] == "4.5" and cfg["architectures"] == ["MiniCPMO"]
    index = json.loads((tiny_ckpt / "model.safetensors.index.json").read_text())
    assert {v for k, v in index["weight_map"].items() if k.startswith("llm.")} == {
        "model-00001-of-00002.safetensors"
    }
    specs = all_specs(cfg)
    assert index["metadata"]["total_size"] == 2 * sum(math.prod(s.shape) for s in specs)
    size = sum(p.stat().st_size for p in tiny_ckpt.rglob("*") if p.is_file())
    assert size < 300 * 2**20
    manifest = read_manifest(tiny_ckpt)
    assert manifest is not None and manifest["generator_version"] == GENERATOR_VERSION
    assert (manifest["size"], manifest["seed"]) == ("tiny", 0)


# --------------------------------------------------------------------------------------- determinism
def test_weights_are_deterministic_for_a_seed(tiny_ckpt: Path, tmp_path: Path) -> None:
    cfg = json.loads((tiny_ckpt / "config.json").read_text())
    write_sharded_weights(tmp_path, all_specs(cfg), seed=0, log=lambda _m: None)
    for shard in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        assert sha256(tmp_path / shard) == sha256(tiny_ckpt / shard), shard
    write_flow(tmp_path, "tiny", 0, "cpu")
    assert sha256(tmp_path / "flow.pt") == sha256(tiny_ckpt / "assets/token2wav/flow.pt")
    spec = TensorSpec("llm.model.norm.weight", (128,))
    assert not torch.equal(make_tensor(0, "model", spec), make_tensor(1, "model", spec))


def test_tokenizer_files_are_deterministic(tiny_ckpt: Path, tmp_path: Path) -> None:
    assert write_tokenizer_files(tmp_path) == 151748
    for name in ("tokenizer.json", "vocab.json", "merges.txt", "tokenizer_config.json"):
        assert sha256(tmp_path / name) == sha256(tiny_ckpt / name), name


def test_init_rules_give_the_intended_scales(tiny_ckpt: Path) -> None:
    t = Checkpoint(tiny_ckpt).load_tensors(["llm.model."], dtype=torch.float32)
    assert abs(t["llm.model.embed_tokens.weight"].std().item() - 1.0) < 0.01  # N(0, 1)
    assert abs(t["llm.model.norm.weight"].mean().item() - 1.0) < 0.05  # 1 + 0.1 N
    q = t["llm.model.layers.0.self_attn.q_proj.weight"]
    assert abs(q.std().item() * math.sqrt(q.shape[1]) - 1.0) < 0.05  # N(0, 1/fan_in)


def test_sharding_by_size_streams_and_loads(tiny_ckpt: Path, tmp_path: Path) -> None:
    """The full-size path: shards packed to a byte budget, written one at a time, loaded back."""
    cfg = json.loads((tiny_ckpt / "config.json").read_text())
    specs = all_specs(cfg)
    budget = 16 * 2**20
    plan = plan_shards(specs, budget)
    assert len(plan) >= 4 and sum(len(g) for g in plan) == len(specs)
    assert all(sum(2 * math.prod(s.shape) for s in g) <= budget or len(g) == 1 for g in plan)
    index = write_sharded_weights(tmp_path, specs, seed=0, max_shard_bytes=budget, log=lambda _m: None)
    assert len(set(index["weight_map"].values())) == len(plan)
    for name in ("config.json",):
        (tmp_path / name).write_bytes((tiny_ckpt / name).read_bytes())
    resharded = Checkpoint(tmp_path).load_tensors(["tts.model.norm."])
    original = Checkpoint(tiny_ckpt).load_tensors(["tts.model.norm."])
    assert torch.equal(resharded["tts.model.norm.weight"], original["tts.model.norm.weight"])


# ----------------------------------------------------------------------------------------- tokenizer
def test_prompts_tokenize_with_real_control_tokens(tiny_ckpt: Path) -> None:
    tok = load_tokenizer(tiny_ckpt)
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)
    assert ids[0] == 151644 and ids[-1] == 151645 and all(i < 151643 for i in ids[1:-1])
    ids = tok.encode("(<image>./</image>)", add_special_tokens=False)
    assert len(ids) == 5 and ids[1] == 151669 and ids[3] == 151670
    text = "Grüße, 世界! <|tts_bos|>spoken<|tts_eos|> 12.5 ms\n\tdone"
    ids = tok.encode(text, add_special_tokens=False)
    assert 151703 in ids and 151704 in ids
    assert tok.decode(ids) == text
    assert tok.convert_ids_to_tokens(128244) == "<unk>"
    vocab = json.loads((tiny_ckpt / "vocab.json").read_text())
    assert len(vocab) == 151643 and vocab["<unk>"] == 128244


def test_merges_form_a_valid_bpe(tiny_ckpt: Path) -> None:
    vocab = json.loads((tiny_ckpt / "vocab.json").read_text())
    lines = (tiny_ckpt / "merges.txt").read_text().splitlines()[1:]
    for line in lines:
        a, b = line.split(" ")
        assert a in vocab and b in vocab and a + b in vocab, line
    assert len(lines) == 151643 - 256 - 1  # every base token except the bytes and <unk> comes from a merge


def test_chat_template_renders_minicpmo_prompts(tiny_ckpt: Path) -> None:
    tok = load_tokenizer(tiny_ckpt)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    text = tok.apply_chat_template(
        msgs[1:], tokenize=False, add_generation_prompt=True, use_tts_template=True
    )
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<|tts_bos|>"
    history = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "<think>x</think>\n\nb"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "<think>\ny\n</think>\n\nd"},
    ]
    text = tok.apply_chat_template(history, tokenize=False)
    assert text == (
        "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\nb<|im_end|>\n"
        "<|im_start|>user\nc<|im_end|>\n<|im_start|>assistant\n<think>\ny\n</think>\n\nd<|im_end|>\n"
    )


def test_bad_token_ids_are_non_text_tokens(tiny_ckpt: Path) -> None:
    cfg = json.loads((tiny_ckpt / "tokenizer_config.json").read_text())
    bad = cfg["bad_token_ids"]
    assert bad == sorted(set(bad)) and 128244 not in bad and max(bad) < 151643
    tok = load_tokenizer(tiny_ckpt)
    hi = tok.encode("hi", add_special_tokens=False)
    assert not set(hi) & set(bad)
    assert tok.convert_tokens_to_ids("\u0120") not in bad  # "Ġ" = a plain space is text


# -------------------------------------------------------------------------------------------- assets
def test_speech_tokenizer_onnx_round_trips_through_s3tokenizer(tiny_ckpt: Path) -> None:
    from s3tokenizer.utils import onnx2torch

    state = onnx2torch(str(tiny_ckpt / "assets/token2wav/speech_tokenizer_v2_25hz.onnx"), None, False)
    specs = s3_state_specs("tiny")
    assert set(state) == {s.name for s in specs}
    for spec in specs:
        want = make_tensor(0, "speech_tokenizer_v2_25hz.onnx", spec)
        assert torch.equal(state[spec.name], want), spec.name


def test_campplus_runs_and_depends_on_input(tiny_ckpt: Path) -> None:
    import onnxruntime

    sess = onnxruntime.InferenceSession(
        str(tiny_ckpt / "assets/token2wav/campplus.onnx"), providers=["CPUExecutionProvider"]
    )
    rng = np.random.default_rng(1)
    feed = sess.get_inputs()[0].name
    a = sess.run(None, {feed: rng.standard_normal((1, 50, 80)).astype(np.float32)})[0]
    b = sess.run(None, {feed: rng.standard_normal((1, 300, 80)).astype(np.float32)})[0]
    assert a.shape == b.shape == (1, 192) and not np.allclose(a, b)


def test_reference_audio_is_six_seconds_of_signal(tiny_ckpt: Path) -> None:
    import soundfile as sf

    audio, rate = sf.read(str(tiny_ckpt / "assets/HT_ref_audio.wav"), dtype="float32")
    assert audio.ndim == 1 and rate == 16000 and len(audio) == 96000
    assert 0.05 < float(np.sqrt(np.mean(audio**2))) and float(np.abs(audio).max()) < 0.99


# ---------------------------------------------------------------------------------------------- full
def test_full_size_plan_has_real_dimensions() -> None:
    cfg = build_config("full")
    specs = {s.name: s.shape for s in all_specs(cfg)}
    assert specs["llm.model.embed_tokens.weight"] == (151748, 4096)
    assert specs["llm.model.layers.35.mlp.gate_proj.weight"] == (12288, 4096)
    assert specs["llm.model.layers.0.self_attn.k_proj.weight"] == (8 * 128, 4096)
    assert specs["vpm.embeddings.position_embedding.weight"] == (4900, 1152)
    assert (
        "vpm.encoder.layers.25.mlp.fc1.weight" in specs
        and "vpm.encoder.layers.26.mlp.fc1.weight" not in specs
    )
    assert specs["resampler.attn.in_proj_weight"] == (3 * 4096, 4096)
    assert specs["apm.layers.23.fc1.weight"] == (4096, 1024)
    assert specs["tts.model.layers.19.mlp.down_proj.weight"] == (768, 3072)
    assert specs["tts.emb_text.weight"] == (152064, 768)
    n_params = sum(math.prod(s) for s in specs.values())
    assert 9.2e9 < n_params < 9.5e9
    plan = plan_shards([TensorSpec(k, v) for k, v in specs.items()], 4 * 2**30)
    assert 4 <= len(plan) <= 6
    assert sum(math.prod(s) for s in (t.shape for t in s3_state_specs("full"))) == 123_714_568


def test_random_hift_is_audible_and_unclipped(tiny_ckpt: Path) -> None:
    from stepaudio2.flashcosyvoice.modules.hifigan import HiFTGenerator

    state = torch.load(str(tiny_ckpt / "assets/token2wav/hift.pt"), map_location="cpu", weights_only=True)
    hift = HiFTGenerator()
    hift.load_state_dict({k.removeprefix("generator."): v for k, v in state.items()})
    mel = torch.randn(1, 80, 20, generator=torch.Generator().manual_seed(0)) * 2 - 5
    f0 = hift.f0_predictor(mel).detach()
    wav, _ = hift.eval()(mel)
    assert 150 < float(f0.mean()) < 300
    assert 0.03 < float(wav.pow(2).mean().sqrt()) < 0.5 and float((wav.abs() > 0.98).float().mean()) < 0.01


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error path of a CPU-only host")
def test_make_on_missing_cuda_fails_cleanly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["make", "--size", "tiny", "--device", "cuda", str(tmp_path / "x")]) == 1
    assert "CUDA is not available" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
