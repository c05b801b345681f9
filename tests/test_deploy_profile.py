"""Deploy profile parser: bundled profiles load, placements are what they claim, bad files are refused."""

from __future__ import annotations

import json

import pytest

from services.common.deploy_profile import (
    CONFIG_DIR,
    STAGE_SETTINGS_ENV,
    ProfileError,
    load_profile,
    parse_overrides,
    parse_profile,
    stage_settings_from_env,
)

BUNDLED = [
    "minicpmo_4_5",
    "minicpmo_4_5_fp8",
    "minicpmo_4_5_2gpu",
    "minicpmo_4_5_3gpu",
    "minicpmo_4_5_8x4090",
    "cpu",
]


def _minimal() -> dict:
    return {"stages": {"thinker": {}, "talker": {}, "code2wav": {}}}


@pytest.mark.parametrize("name", BUNDLED)
def test_bundled_profiles_load(name: str) -> None:
    profile = load_profile(name)
    assert profile.name == name
    assert set(profile.stages) == {"thinker", "talker", "code2wav"}
    assert profile.served_model_name == "openbmb/MiniCPM-o-4_5"
    # round trip through the dict form gives the same profile
    assert parse_profile(profile.to_dict(), source=name).to_dict() == profile.to_dict()


def test_bundled_files_exist() -> None:
    assert {p.stem for p in CONFIG_DIR.glob("*.yaml")} >= set(BUNDLED)


def test_default_profile_is_single_gpu() -> None:
    profile = load_profile(None)
    assert profile.name == "minicpmo_4_5"
    assert {d for sp in profile.stages.values() for d in sp.devices} == {"cuda:0"}
    # shares measured on one H200 (see the profile's comment); 12 % left for the three CUDA contexts
    fractions = [profile.stage(s).memory_fraction for s in ("thinker", "talker", "code2wav")]
    assert fractions == [0.40, 0.08, 0.40]
    # 16 realtime sessions (one thinker sequence each, one talker + code2wav stream while speaking) and
    # chat requests beside them on the thinker; code2wav's value is its batch (8: 16 ran out of memory)
    assert [profile.stage(s).max_num_seqs for s in ("thinker", "talker", "code2wav")] == [24, 16, 8]
    talker = profile.stage("talker")
    assert (talker.codec.window_frames, talker.codec.left_context_frames) == (25, 3)
    assert talker.codec.first_window_frames == 10  # TTFP c=1: 240 ms vs 307 ms with 25
    assert talker.sampling["top_k"] == 25 and talker.sampling["temperature"] == pytest.approx(0.8)
    # one thinker sequence per duplex session, 8 left for chat; profiles that do not say keep the default of 4
    assert profile.gateway.max_realtime_sessions == 16
    assert profile.gateway.max_realtime_sessions < profile.stage("thinker").max_num_seqs
    assert load_profile("cpu").gateway.max_realtime_sessions == 4


def test_8x4090_thinker_replicas_one_per_gpu() -> None:
    profile = load_profile("8x4090")
    assert profile.stage("thinker").devices == ("cuda:0", "cuda:1", "cuda:2", "cuda:3")
    assert profile.stage("talker").devices == ("cuda:4", "cuda:5")
    assert profile.stage("code2wav").devices == ("cuda:6", "cuda:7")
    assert "tensor parallelism" in profile.description
    thinker = profile.stage("thinker")
    ports = [thinker.replica_port(i) for i in range(thinker.replicas)]
    assert ports == [50051, 50061, 50071, 50081]
    all_ports = [sp.replica_port(i) for sp in profile.stages.values() for i in range(sp.replicas)]
    assert len(set(all_ports)) == len(all_ports)


def test_with_device_cpu_keeps_replicas() -> None:
    profile = load_profile("8x4090").with_device("cpu")
    assert profile.stage("thinker").devices == ("cpu",) * 4


def test_overrides_merge_and_revalidate() -> None:
    profile = load_profile("cpu").with_overrides(
        parse_overrides('{"thinker": {"max_num_seqs": 2, "sampling": {"temperature": 0.5}}}')
    )
    thinker = profile.stage("thinker")
    assert thinker.max_num_seqs == 2
    assert thinker.sampling["temperature"] == 0.5
    assert thinker.sampling["max_tokens"] == 24  # untouched keys survive the merge
    with pytest.raises(ProfileError, match="unknown sampling key"):
        load_profile("cpu").with_overrides({"talker": {"sampling": {"temprature": 1.0}}})
    with pytest.raises(ProfileError, match="unknown key"):
        load_profile("cpu").with_overrides({"vocoder": {}})
    with pytest.raises(ProfileError, match="not valid JSON"):
        parse_overrides("{thinker")


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d["stages"].pop("talker"), "stages missing"),
        (lambda d: d["stages"]["thinker"].update(devices=["gpu0"]), "cuda:N"),
        (lambda d: d["stages"]["thinker"].update(memory_fraction=1.5), "memory_fraction"),
        (lambda d: d["stages"]["thinker"].update(max_num_seqs="4"), "expected"),
        (lambda d: d["stages"]["code2wav"].update(codec={"window_frames": 25}), "talker setting"),
        (lambda d: d["stages"]["talker"].update(codec={"window_frames": 0}), "out of range"),
        (lambda d: d["stages"]["thinker"].update(devices=[], device="cpu"), "either"),
        (lambda d: d.update(version=2), "version"),
        (lambda d: d.update(gateway={"prot": 1}), "unknown key"),
        (lambda d: d.update(gateway={"max_realtime_sessions": 0}), "max_realtime_sessions"),
        (lambda d: d["stages"]["thinker"].update(sampling={"temperature": -1}), "non-negative"),
        (lambda d: d["stages"]["thinker"].update(duplex_window="context"), "'off' or 'basic'"),
        (lambda d: d["stages"]["thinker"].update(duplex_window_low=8000), "duplex_window_low"),
        (lambda d: d["stages"]["thinker"].update(max_model_len=4096), "exceeds max_model_len"),
        (lambda d: d["stages"]["talker"].update(duplex_window="basic"), "thinker setting"),
    ],
)
def test_invalid_profiles_are_refused(mutate, message: str) -> None:
    raw = _minimal()
    mutate(raw)
    with pytest.raises(ProfileError, match=message):
        parse_profile(raw)


def test_device_plus_replicas_shorthand() -> None:
    raw = _minimal()
    raw["stages"]["talker"] = {"device": "cuda:1", "replicas": 3}
    profile = parse_profile(raw)
    assert profile.stage("talker").devices == ("cuda:1",) * 3
    assert profile.stage("thinker").devices == ("cpu",)


def test_stage_settings_env_round_trip(monkeypatch: pytest.MonkeyPatch) -> None:
    talker = load_profile("2gpu").stage("talker")
    monkeypatch.setenv(STAGE_SETTINGS_ENV, talker.settings_json())
    settings = stage_settings_from_env("talker")
    assert settings is not None and settings["max_num_seqs"] == talker.max_num_seqs
    assert json.loads(talker.settings_json())["devices"] == ["cuda:1"]
    assert stage_settings_from_env("thinker") is None


@pytest.mark.parametrize("name", BUNDLED)
def test_every_bundled_profile_slides_the_duplex_window(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Long calls trim instead of ending with context_length_exceeded, and the thinker CLI runs with the
    profile's window when it only gets its section through the environment (containers)."""
    from services.common.stage_settings import parse_stage_args
    from services.thinker.__main__ import build_parser

    thinker = load_profile(name).stage("thinker")
    assert thinker.duplex_window == "basic"
    assert 0 < thinker.duplex_window_low < thinker.duplex_window_high <= (thinker.max_model_len or 40960)
    monkeypatch.setenv(STAGE_SETTINGS_ENV, thinker.settings_json())
    args, _ = parse_stage_args(build_parser(), "thinker", ["--checkpoint", "/ckpt"])
    assert (args.duplex_window, args.duplex_window_high, args.duplex_window_low) == (
        "basic",
        thinker.duplex_window_high,
        thinker.duplex_window_low,
    )
    assert "duplex_window" not in load_profile(name).to_dict()["stages"]["talker"]


def test_a_profile_can_turn_the_window_off() -> None:
    raw = _minimal()
    raw["stages"]["thinker"] = {"duplex_window": "off"}
    assert parse_profile(raw).stage("thinker").duplex_window == "off"
