"""Stage memory caps on CPU: ``--memory-fraction`` / profile parsing in every stage CLI, the cap applied
through a faked CUDA API, and the thinker's KV budget arithmetic with real H200 / RTX 4090 numbers."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from services.common.deploy_profile import STAGE_SETTINGS_ENV, load_profile
from services.common.stage_settings import (
    MEMORY_FRACTION_FLAG,
    MemoryFractionChoice,
    apply_memory_cap,
    check_memory_fraction,
    parse_stage_args,
    resolve_memory_fraction,
)
from services.thinker.kv_cache import (
    KV_HEADROOM_BYTES,
    KVBudgetError,
    KVLayout,
    check_explicit_kv_budget,
    check_kv_budget,
    default_kv_budget,
    kv_budget_for_memory_fraction,
)

GIB = 2**30
H200_BYTES = 143_771 * 2**20  # what torch reports for the H200 the profile was measured on
RTX4090_BYTES = int(23.65 * GIB)
H100_BYTES = int(79.19 * GIB)  # an 80 GB H100 as torch reports it
THINKER_WEIGHTS = int(16.4 * GIB)  # 16.4 GB measured, counted as GiB to stay on the safe side


def _parsers() -> dict[str, Callable[[], Any]]:
    from services.code2wav.__main__ import build_parser as code2wav_parser
    from services.talker.server import build_parser as talker_parser
    from services.thinker.__main__ import build_parser as thinker_parser

    return {"thinker": thinker_parser, "talker": talker_parser, "code2wav": code2wav_parser}


# ---- KV arithmetic ------------------------------------------------------------------------------
def test_kv_budget_is_the_cap_minus_weights_and_headroom() -> None:
    budget = kv_budget_for_memory_fraction(0.40, H200_BYTES, THINKER_WEIGHTS)
    assert budget == int(0.40 * H200_BYTES) - THINKER_WEIGHTS - KV_HEADROOM_BYTES
    assert KV_HEADROOM_BYTES == 2 * GIB
    assert 37 * GIB < budget < 38 * GIB  # the profile comment's "~38 GiB"
    assert kv_budget_for_memory_fraction(0.5, 100 * GIB, 10 * GIB, headroom_bytes=GIB) == 39 * GIB


def test_kv_budget_error_names_the_numbers_and_the_setting() -> None:
    # 0.70 of a 4090 = 16.55 GiB < 16.4 GiB weights + 2 GiB headroom
    with pytest.raises(KVBudgetError) as info:
        kv_budget_for_memory_fraction(0.70, RTX4090_BYTES, THINKER_WEIGHTS)
    message = str(info.value)
    for text in (
        "stages.thinker.memory_fraction = 0.7",
        "16.55 GiB",
        "23.65 GiB",
        "16.40 GiB",
        "2.00 GiB",
        "at least 0.779",
        "--kv-budget",
    ):
        assert text in message, (text, message)
    with pytest.raises(KVBudgetError, match="--memory-fraction = 0.1"):
        kv_budget_for_memory_fraction(0.1, RTX4090_BYTES, THINKER_WEIGHTS, key="--memory-fraction")
    # exactly enough for the minimum pool passes; one byte less does not
    total, held, least = 100 * GIB, 10 * GIB, 1 << 20
    fraction = (held + KV_HEADROOM_BYTES + least) / total
    assert kv_budget_for_memory_fraction(fraction, total, held, min_bytes=least) >= least - 1
    with pytest.raises(KVBudgetError):
        kv_budget_for_memory_fraction(fraction * 0.999, total, held, min_bytes=least)


def test_explicit_kv_budget_is_checked_against_the_cap() -> None:
    """The H100 failure: --kv-budget 16G under a 0.40 cap with 16.6 GiB of weights (13.08 GiB of room)."""
    weights = int(16.6 * GIB)
    with pytest.raises(KVBudgetError) as info:
        check_kv_budget(16 * GIB, total_bytes=H100_BYTES, held_bytes=weights, fraction=0.40)
    message = str(info.value)
    for text in (
        "--kv-budget 16.00 GiB",
        "stages.thinker.memory_fraction = 0.4",
        "31.68 GiB",
        "16.60 GiB",
        "13.08 GiB",
        "--kv-budget auto",
        "at least 0.437",
    ):
        assert text in message, (text, message)
    check_kv_budget(13 * GIB, total_bytes=H100_BYTES, held_bytes=weights, fraction=0.40)
    check_kv_budget(16 * GIB, total_bytes=H200_BYTES, held_bytes=weights, fraction=0.40)  # 37.6 GiB room
    # Without a fraction the free memory bounds it.
    check_kv_budget(10 * GIB, total_bytes=H100_BYTES, held_bytes=weights, free_bytes=12 * GIB)
    with pytest.raises(KVBudgetError, match="free device memory"):
        check_kv_budget(11 * GIB, total_bytes=H100_BYTES, held_bytes=weights, free_bytes=12 * GIB)


def test_explicit_budget_check_reads_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cuda(monkeypatch, total=H100_BYTES, reserved=int(16.6 * GIB), free=60 * GIB)
    cuda = torch.device("cuda:0")
    with pytest.raises(KVBudgetError, match="--memory-fraction = 0.4"):
        check_explicit_kv_budget(16 * GIB, cuda, 0.40, "--memory-fraction")
    check_explicit_kv_budget(12 * GIB, cuda, 0.40)
    check_explicit_kv_budget(50 * GIB, cuda)  # no cap: 60 GiB free
    with pytest.raises(KVBudgetError):
        check_explicit_kv_budget(12 * GIB, cuda, 0.40, reserve_bytes=2 * GIB)  # duplex caches' share
    check_explicit_kv_budget(1 << 40, torch.device("cpu"), 0.01)  # CPU: the operator's call


def test_kv_budget_flag_takes_auto() -> None:
    from services.thinker.__main__ import build_parser

    parser = build_parser()
    assert parser.parse_args(["--checkpoint", "x", "--kv-budget", "auto"]).kv_budget is None
    assert parser.parse_args(["--checkpoint", "x", "--kv-budget", "1.5GiB"]).kv_budget == int(1.5 * GIB)


def _layout() -> KVLayout:
    return KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32, block_size=16)


def _fake_cuda(monkeypatch: pytest.MonkeyPatch, total: int, reserved: int, free: int) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _d: SimpleNamespace(total_memory=total))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda _d=None: reserved)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda _d=None: reserved - 1)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda _d=None: (free, total))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)


def test_default_budget_on_cuda_follows_the_fraction_else_free_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _fake_cuda(monkeypatch, total=H200_BYTES, reserved=THINKER_WEIGHTS, free=40 * GIB)
    cuda = torch.device("cuda:0")
    with_fraction = default_kv_budget(_layout(), cuda, 4096, 8, memory_fraction=0.40)
    assert with_fraction == int(0.40 * H200_BYTES) - THINKER_WEIGHTS - KV_HEADROOM_BYTES
    # without a fraction: today's behaviour, 90 % of free memory beyond the headroom
    assert default_kv_budget(_layout(), cuda, 4096, 8) == int((40 - 2) * GIB * 0.9)
    with pytest.raises(KVBudgetError, match="--memory-fraction = 0.05"):
        default_kv_budget(
            _layout(), cuda, 4096, 8, memory_fraction=0.05, memory_fraction_key="--memory-fraction"
        )


def test_default_budget_on_cpu_ignores_the_fraction() -> None:
    layout = _layout()
    want = layout.bytes_per_token * 4096 * 4
    assert default_kv_budget(layout, torch.device("cpu"), 4096, 4, memory_fraction=0.01) == want


def test_kv_budget_flag_wins_over_the_fraction(monkeypatch: pytest.MonkeyPatch, tiny_ckpt: Path) -> None:
    """The engine sizes the pool itself only without --kv-budget, so the cap is then never consulted."""
    import services.thinker.engine as engine_mod
    from services.common.checkpoint import Checkpoint
    from services.thinker.runner import build_qwen3_llm

    def refuse(*_a: Any, **_k: Any) -> int:
        raise AssertionError("default_kv_budget must not run when kv_budget_bytes is given")

    ckpt = Checkpoint(tiny_ckpt)
    llm = build_qwen3_llm(
        ckpt.config,
        ckpt.load_tensors(["llm."], strip_prefix="llm.", dtype=torch.float32),
        torch.float32,
        "cpu",
    )
    monkeypatch.setattr(engine_mod, "default_kv_budget", refuse)
    cfg = engine_mod.EngineConfig(kv_budget_bytes=1 << 20, memory_fraction=0.01, use_cuda_graphs=False)
    engine = engine_mod.ThinkerEngine(llm, cfg, "cpu")
    assert 0 < engine.cache.budget_bytes <= 1 << 20


# ---- bundled profiles against their cards --------------------------------------------------------
# Every card each GPU profile is written for (torch's total_memory): the 80 GB / 141 GB profiles run
# on an H100 and an H200 alike.
PROFILE_CARDS = {
    "minicpmo_4_5": (H100_BYTES, H200_BYTES),
    "minicpmo_4_5_2gpu": (H100_BYTES, H200_BYTES),
    "minicpmo_4_5_3gpu": (H100_BYTES, H200_BYTES),
    "minicpmo_4_5_8x4090": (RTX4090_BYTES,),
}
QWEN3_8B_KV_BYTES_PER_TOKEN = 2 * 36 * 8 * 128 * 2  # K and V, 36 layers, 8 KV heads, head_dim 128, bf16


@pytest.mark.parametrize("name", sorted(PROFILE_CARDS))
def test_thinker_fraction_holds_weights_and_one_full_sequence(name: str) -> None:
    thinker = load_profile(name).stage("thinker")
    assert thinker.memory_fraction is not None and thinker.max_model_len is not None
    for card in PROFILE_CARDS[name]:
        # 16.6 GiB: what the thinker held on an H100 (the weights plus the CUDA allocator's rounding)
        held = max(THINKER_WEIGHTS, int(16.6 * GIB)) if card == H100_BYTES else THINKER_WEIGHTS
        budget = kv_budget_for_memory_fraction(thinker.memory_fraction, card, held)
        assert budget >= thinker.max_model_len * QWEN3_8B_KV_BYTES_PER_TOKEN, (name, card)


@pytest.mark.parametrize("name", sorted(PROFILE_CARDS))
def test_shares_of_one_card_leave_room_for_cuda_contexts(name: str) -> None:
    per_card: dict[str, float] = {}
    for sp in load_profile(name).stages.values():
        for device in sp.devices:
            per_card[device] = per_card.get(device, 0.0) + (sp.memory_fraction or 0.0)
    assert max(per_card.values()) <= 0.95, per_card


# ---- flag / environment resolution ---------------------------------------------------------------
def test_check_memory_fraction_bounds() -> None:
    assert check_memory_fraction("1", "x") == 1.0
    assert check_memory_fraction(0.4, "x") == 0.4
    for bad in (0, -0.1, 1.01, "nan", "abc", True, None):
        with pytest.raises(ValueError, match=r"x: must be"):
            check_memory_fraction(bad, "x")


def test_flag_wins_over_profile_and_neither_means_no_cap() -> None:
    settings = {"name": "talker", "memory_fraction": 0.08}
    assert resolve_memory_fraction("talker", 0.5, settings) == MemoryFractionChoice(0.5, MEMORY_FRACTION_FLAG)
    from_profile = resolve_memory_fraction("talker", None, settings)
    assert from_profile == MemoryFractionChoice(0.08, "stages.talker.memory_fraction")
    assert STAGE_SETTINGS_ENV in from_profile.source
    assert resolve_memory_fraction("talker", None, None).fraction is None
    assert (
        resolve_memory_fraction("talker", None, {"name": "talker", "memory_fraction": None}).fraction is None
    )


STAGE_ARGV = ["--checkpoint", "/ckpt", "--device", "cuda:0"]
# where each stage CLI keeps the profile's max_num_seqs
MAX_SEQS_DEST = {"thinker": "max_num_seqs", "talker": "max_streams", "code2wav": "max_batch"}


@pytest.mark.parametrize("stage", ["thinker", "talker", "code2wav"])
@pytest.mark.parametrize("value", ["0", "-0.5", "1.5", "abc", "nan"])
def test_every_stage_refuses_a_bad_memory_fraction(
    stage: str, value: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(STAGE_SETTINGS_ENV, raising=False)
    with pytest.raises(SystemExit) as info:
        parse_stage_args(_parsers()[stage](), stage, [*STAGE_ARGV, "--memory-fraction", value])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --memory-fraction: must be" in err and "(0, 1]" in err and repr(value) in err


@pytest.mark.parametrize("stage", ["thinker", "talker", "code2wav"])
def test_bad_memory_fraction_in_the_profile_section(
    stage: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(STAGE_SETTINGS_ENV, json.dumps({"name": stage, "memory_fraction": 0}))
    with pytest.raises(SystemExit):
        parse_stage_args(_parsers()[stage](), stage, STAGE_ARGV)
    assert (
        f"{STAGE_SETTINGS_ENV}: stages.{stage}.memory_fraction: must be in (0, 1], got 0"
        in capsys.readouterr().err
    )


@pytest.mark.parametrize("stage", ["thinker", "talker", "code2wav"])
def test_every_stage_takes_its_profile_section_and_flags_win(
    stage: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    section = load_profile("minicpmo_4_5").stage(stage)
    monkeypatch.setenv(STAGE_SETTINGS_ENV, section.settings_json())
    args, choice = parse_stage_args(_parsers()[stage](), stage, STAGE_ARGV)
    assert choice == MemoryFractionChoice(section.memory_fraction, f"stages.{stage}.memory_fraction")
    # the 1-GPU profile: 16 realtime sessions (talker streams) plus 8 thinker sequences for chat; code2wav
    # batches 8 windows a step
    assert (
        getattr(args, MAX_SEQS_DEST[stage])
        == section.max_num_seqs
        == {"thinker": 24, "code2wav": 8}.get(stage, 16)
    )
    if stage == "thinker":
        assert (args.max_context, args.dtype) == (section.max_model_len, section.dtype)
    flag = {"thinker": "--max-num-seqs", "talker": "--max-streams", "code2wav": "--max-batch"}[stage]
    args, choice = parse_stage_args(
        _parsers()[stage](), stage, [*STAGE_ARGV, "--memory-fraction", "0.25", flag, "3"]
    )
    assert choice == MemoryFractionChoice(0.25, MEMORY_FRACTION_FLAG)
    assert getattr(args, MAX_SEQS_DEST[stage]) == 3
    # another stage's section is not ours: CLI defaults, no cap
    other = "talker" if stage != "talker" else "thinker"
    monkeypatch.setenv(STAGE_SETTINGS_ENV, load_profile("minicpmo_4_5").stage(other).settings_json())
    args, choice = parse_stage_args(_parsers()[stage](), stage, STAGE_ARGV)
    assert choice.fraction is None
    assert getattr(args, MAX_SEQS_DEST[stage]) == _parsers()[stage]().get_default(MAX_SEQS_DEST[stage])


def test_settings_that_are_not_json_are_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(STAGE_SETTINGS_ENV, "{thinker")
    with pytest.raises(SystemExit):
        parse_stage_args(_parsers()["thinker"](), "thinker", STAGE_ARGV)
    assert f"{STAGE_SETTINGS_ENV} is not valid JSON" in capsys.readouterr().err


# ---- applying the cap ----------------------------------------------------------------------------
def test_cap_is_applied_on_cuda_and_logged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    calls: list[tuple[float, int]] = []
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, i=None: calls.append((f, i)))
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda _d: SimpleNamespace(total_memory=H200_BYTES)
    )
    log = logging.getLogger("test.stage_memory")
    choice = MemoryFractionChoice(0.4, "stages.thinker.memory_fraction")
    with caplog.at_level(logging.INFO, logger="test.stage_memory"):
        assert apply_memory_cap("thinker", "cuda:1", choice, log) == 0.4
    assert calls == [(0.4, 1)]
    assert "capped at 0.4 of cuda:1 = 56.2 GiB of 140.4 GiB" in caplog.text
    assert "stages.thinker.memory_fraction via MINICPMO_STAGE_SETTINGS" in caplog.text


def test_a_refused_mps_client_exits_saying_why_and_what_to_restart(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA's first initialisation refused by an MPS server (what a stage restarted alone after a SIGKILL
    under MPS gets): the stage exits with the reason and what to restart, which the launcher's log check
    recognises; any other CUDA error is raised as it is."""
    from services.common.gpu_sharing import mps_refused

    def refused(*_a: Any) -> None:
        raise RuntimeError(
            "Unexpected error from cudaGetDeviceCount(). Error 807: MPS server is not ready to accept new "
            "MPS client requests"
        )

    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", refused)
    log = logging.getLogger("test.stage_memory")
    with pytest.raises(SystemExit) as info:
        apply_memory_cap("code2wav", "cuda:0", MemoryFractionChoice(0.4), log)
    message = str(info.value.code)
    assert message.startswith("code2wav: the MPS server is not ready to accept new clients")
    assert "docker compose restart thinker talker code2wav" in message
    assert mps_refused(message)  # what the launcher looks for in a dead stage's log

    def other(*_a: Any) -> None:
        raise RuntimeError("CUDA error: no CUDA-capable device is detected")

    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", other)
    with pytest.raises(RuntimeError, match="no CUDA-capable device"):
        apply_memory_cap("code2wav", "cuda:0", MemoryFractionChoice(0.4), log)


def test_cap_is_a_no_op_on_cpu_and_without_a_fraction(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def refuse(*_a: Any) -> None:
        raise AssertionError("no CUDA call on CPU or without a fraction")

    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", refuse)
    log = logging.getLogger("test.stage_memory")
    with caplog.at_level(logging.INFO, logger="test.stage_memory"):
        assert apply_memory_cap("talker", "cpu", MemoryFractionChoice(0.08), log) is None
        assert apply_memory_cap("talker", "cuda", MemoryFractionChoice(None), log) is None
    assert "ignored on cpu" in caplog.text and "no GPU memory cap" in caplog.text


# ---- the CLIs wire it through before loading weights ---------------------------------------------
class _Stop(Exception):
    pass


def test_thinker_cli_passes_the_cap_to_the_kv_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    import services.thinker.__main__ as server

    applied: list[float] = []
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, i=None: applied.append(f))
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda _d: SimpleNamespace(total_memory=H200_BYTES)
    )
    seen: dict[str, Any] = {}

    def fake_build(checkpoint: str, device: str, dtype: str | None, cfg: Any, whisper_graphs: bool) -> Any:
        seen.update(cfg=cfg, applied_before_load=list(applied))
        raise _Stop

    monkeypatch.setattr(server, "build_backend", fake_build)
    monkeypatch.setenv(STAGE_SETTINGS_ENV, load_profile("minicpmo_4_5").stage("thinker").settings_json())
    with pytest.raises(_Stop):
        server.main(STAGE_ARGV)
    cfg = seen["cfg"]
    assert seen["applied_before_load"] == [0.4]
    assert (cfg.memory_fraction, cfg.memory_fraction_key, cfg.max_num_seqs) == (
        0.4,
        "stages.thinker.memory_fraction",
        24,
    )
    assert cfg.kv_budget_bytes is None

    with pytest.raises(_Stop):
        server.main([*STAGE_ARGV, "--memory-fraction", "0.5", "--kv-budget", "4G"])
    assert (seen["cfg"].memory_fraction, seen["cfg"].kv_budget_bytes) == (0.5, 4 * GIB)

    def too_small(*_a: Any, **_kw: Any) -> Any:
        raise KVBudgetError("stages.thinker.memory_fraction = 0.1 caps the thinker at ...")

    monkeypatch.setattr(server, "build_backend", too_small)
    with pytest.raises(SystemExit, match=r"^thinker: stages.thinker.memory_fraction = 0.1"):
        server.main(STAGE_ARGV)


def test_talker_and_code2wav_clis_cap_before_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    import services.code2wav.__main__ as code2wav_cli
    import services.talker.server as talker_server

    applied: list[float] = []
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, i=None: applied.append(f))
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda _d: SimpleNamespace(total_memory=H200_BYTES)
    )
    loaded: list[tuple[str, list[float], int]] = []

    def fake_talker(
        checkpoint: str, device: str, dtype: str | None, max_streams: int, graphs: Any, **_settings: Any
    ) -> Any:
        loaded.append(("talker", list(applied), max_streams))
        raise _Stop

    async def fake_serve(args: Any) -> None:
        loaded.append(("code2wav", list(applied), args.max_batch))
        raise _Stop

    monkeypatch.setattr(talker_server, "build_engine", fake_talker)
    monkeypatch.setattr(code2wav_cli, "_serve", fake_serve)
    profile = load_profile("minicpmo_4_5")
    monkeypatch.setenv(STAGE_SETTINGS_ENV, profile.stage("talker").settings_json())
    with pytest.raises(_Stop):
        talker_server.main(STAGE_ARGV)
    monkeypatch.setenv(STAGE_SETTINGS_ENV, profile.stage("code2wav").settings_json())
    with pytest.raises(_Stop):
        code2wav_cli.main([*STAGE_ARGV, "--memory-fraction", "0.3"])
    assert loaded == [("talker", [0.08], 16), ("code2wav", [0.08, 0.3], 8)]


@pytest.mark.parametrize("stage", ["thinker", "talker", "code2wav"])
def test_gpu_priority_from_the_profile_or_the_flag_sets_the_mps_client_priority(
    stage: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``stages.<stage>.gpu_priority: below_normal`` (or ``--gpu-priority``) makes the stage a below-normal
    MPS client before it touches CUDA; ``normal`` leaves the environment alone."""
    import json

    from services.common.gpu_sharing import PRIORITY_ENV

    monkeypatch.delenv(PRIORITY_ENV, raising=False)
    monkeypatch.setenv(STAGE_SETTINGS_ENV, json.dumps({"name": stage, "gpu_priority": "normal"}))
    args, _ = parse_stage_args(_parsers()[stage](), stage, STAGE_ARGV)
    assert args.gpu_priority == "normal" and PRIORITY_ENV not in os.environ
    monkeypatch.setenv(STAGE_SETTINGS_ENV, json.dumps({"name": stage, "gpu_priority": "below_normal"}))
    args, _ = parse_stage_args(_parsers()[stage](), stage, STAGE_ARGV)
    assert args.gpu_priority == "below_normal" and os.environ[PRIORITY_ENV] == "1"
    monkeypatch.delenv(PRIORITY_ENV)
    monkeypatch.delenv(STAGE_SETTINGS_ENV)
    parse_stage_args(_parsers()[stage](), stage, [*STAGE_ARGV, "--gpu-priority", "below_normal"])
    assert os.environ[PRIORITY_ENV] == "1"


# ---- talker slots --------------------------------------------------------------------------------
TALKER_SLOT_BYTES = 2 * 20 * 4097 * 12 * 64 * 2  # K and V, 20 layers, 4096 positions + scratch, 12 heads × 64
TALKER_WEIGHTS = int(0.62 * GIB)  # ~330 M bf16 parameters, rounded up


def test_talker_slot_bytes_and_the_budget_error() -> None:
    from services.talker.kv_cache import SLOT_HEADROOM_BYTES, SlotBudgetError, check_slot_budget, slot_bytes

    assert slot_bytes(20, 12, 64, 4096, torch.bfloat16) == TALKER_SLOT_BYTES  # 0.23 GiB a stream
    check_slot_budget(16, TALKER_SLOT_BYTES, 0.08, H100_BYTES, TALKER_WEIGHTS)  # the profile's 16 fit
    with pytest.raises(SlotBudgetError) as err:
        check_slot_budget(24, TALKER_SLOT_BYTES, 0.08, H100_BYTES, TALKER_WEIGHTS)
    message = str(err.value)
    assert "24 streams need 5.63 GiB of KV (0.23 GiB each)" in message
    assert "stages.talker.memory_fraction 0.08 of 79.19 GiB = 6.34 GiB" in message
    assert "room for 19" in message and "at least 0.095" in message and "(--max-streams) to 19" in message
    # the suggested fraction really holds the 24 slots
    check_slot_budget(24, TALKER_SLOT_BYTES, 0.095, H100_BYTES, TALKER_WEIGHTS)
    assert SLOT_HEADROOM_BYTES == 1280 * 2**20


@pytest.mark.parametrize("name", sorted(PROFILE_CARDS))
def test_talker_fraction_holds_its_streams_slots(name: str) -> None:
    from services.talker.kv_cache import check_slot_budget

    talker = load_profile(name).stage("talker")
    assert talker.memory_fraction is not None and talker.max_num_seqs is not None
    for card in PROFILE_CARDS[name]:
        check_slot_budget(
            talker.max_num_seqs, TALKER_SLOT_BYTES, talker.memory_fraction, card, TALKER_WEIGHTS
        )


def test_talker_cli_passes_its_cap_to_the_slot_check_and_exits_with_its_message(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import services.talker.server as talker_server
    from services.talker.kv_cache import SlotBudgetError

    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, i=None: None)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda _d: SimpleNamespace(total_memory=H100_BYTES)
    )
    caps: list[Any] = []

    def refuse(*_args: Any, memory_cap: Any = None, **_settings: Any) -> Any:
        caps.append(memory_cap)
        raise SlotBudgetError("24 streams need 5.63 GiB of KV")

    monkeypatch.setattr(talker_server, "build_engine", refuse)
    monkeypatch.setenv(STAGE_SETTINGS_ENV, load_profile("minicpmo_4_5").stage("talker").settings_json())
    with pytest.raises(SystemExit, match="^talker: 24 streams need 5.63 GiB of KV$"):
        talker_server.main(STAGE_ARGV)
    assert caps == [(0.08, "stages.talker.memory_fraction")]
