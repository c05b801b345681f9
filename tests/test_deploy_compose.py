"""docker-compose.yml and its layout overrides, offline: every file validates against the compose spec and
yamllint, and each layout's merged configuration pins GPUs, ports, health checks and the deploy profile
exactly as that layout's profile says. Negative tests prove a typo or a wrong GPU fails."""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from services.common.deploy_profile import STAGES, load_profile
from tests.deploy_checks import (
    LAYOUTS,
    REPO,
    check_compose_layout,
    check_compose_stage_settings,
    compose_config,
    compose_stage_services,
    validate_compose_schema,
    yamllint_problems,
)

pytest.importorskip(
    "check_jsonschema", reason="check-jsonschema is a dev dependency (pip install -e '.[dev]')"
)

COMPOSE_FILES = sorted({p for layout in LAYOUTS.values() for p in layout.compose_files})


def test_every_compose_file_belongs_to_a_layout() -> None:
    shipped = {
        REPO / "docker-compose.yml",
        REPO / "docker-compose.override.yml",
        *(REPO / "compose").glob("*.yml"),
    }
    assert shipped == set(COMPOSE_FILES)


def test_compose_files_match_the_compose_spec() -> None:
    assert validate_compose_schema(COMPOSE_FILES) == []


def test_compose_files_pass_yamllint() -> None:
    assert yamllint_problems(COMPOSE_FILES) == []


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_layout_matches_its_profile(layout: str) -> None:
    spec = LAYOUTS[layout]
    config = compose_config(spec.compose_files)
    profile = load_profile(spec.profile)
    assert check_compose_layout(config, profile, f"{spec.profile}.yaml") == []


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_stages_run_with_the_profiles_memory_share_and_limits(layout: str) -> None:
    """Compose starts stages without the launcher: the image entrypoint + stage CLI apply the profile."""
    spec = LAYOUTS[layout]
    assert check_compose_stage_settings(compose_config(spec.compose_files), load_profile(spec.profile)) == []


def test_a_command_line_flag_overriding_the_profile_is_caught() -> None:
    spec = LAYOUTS["1gpu"]
    config = compose_config(spec.compose_files)
    config["services"]["code2wav"]["command"] = [
        *config["services"]["code2wav"]["command"],
        "--memory-fraction",
        "0.9",
        "--max-batch",
        "4",
    ]
    problems = check_compose_stage_settings(config, load_profile(spec.profile))
    assert len(problems) == 2
    assert "memory fraction 0.9 (--memory-fraction), profile says 0.4" in problems[0]
    assert "max_num_seqs 4, profile says 8" in problems[1]


def test_profiles_named_by_compose_exist_in_the_mounted_directory() -> None:
    for spec in LAYOUTS.values():
        assert (REPO / "configs" / "deploy" / f"{spec.profile}.yaml").is_file()


def test_cpu_layout_uses_host_networking_on_loopback_only() -> None:
    config = compose_config(LAYOUTS["cpu"].compose_files)
    assert "networks" not in config
    for name, svc in config["services"].items():
        assert svc.get("network_mode") == "host", name
        assert not svc.get("ports"), f"{name}: host networking publishes nothing"
        argv = [str(a) for a in svc["command"]]
        assert argv[argv.index("--host") + 1] == "127.0.0.1", f"{name} must bind loopback only"
        assert str(svc.get("image", "")).endswith(("-cpu", "-gateway")), name


def test_cpu_layout_ports_move_together() -> None:
    """On a shared host the CPU layout's ports can be moved; the gateway and health checks follow."""
    env = {
        "MINICPMO_THINKER_PORT": "41051",
        "MINICPMO_TALKER_PORT": "41052",
        "MINICPMO_CODE2WAV_PORT": "41053",
    }
    config = compose_config(LAYOUTS["cpu"].compose_files, env)
    profile = load_profile("cpu").with_overrides(
        {s: {"port": int(p)} for s, p in zip(("thinker", "talker", "code2wav"), env.values(), strict=True)}
    )
    assert check_compose_layout(config, profile, "cpu.yaml") == []


def test_replicas_share_the_stage_name_for_dns_balancing() -> None:
    config = compose_config(LAYOUTS["8x4090"].compose_files)
    assert sorted(compose_stage_services(config, "thinker")) == [
        "thinker",
        "thinker-1",
        "thinker-2",
        "thinker-3",
    ]
    assert sorted(compose_stage_services(config, "code2wav")) == ["code2wav", "code2wav-1"]


def test_stop_grace_outlasts_the_drain() -> None:
    for spec in LAYOUTS.values():
        config = compose_config(spec.compose_files)
        stage_services = {n: s for stage in STAGES for n, s in compose_stage_services(config, stage).items()}
        assert stage_services, spec.name
        for name, svc in stage_services.items():
            argv = [str(a) for a in svc["command"]]
            drain = float(argv[argv.index("--drain-timeout") + 1])
            grace = svc.get("stop_grace_period", "10s")
            assert grace.endswith("s") and float(grace[:-1]) > drain, (
                f"{spec.name}/{name}: {grace} <= {drain}s"
            )


@pytest.mark.skipif(
    shutil.which("docker-compose") is None, reason="docker-compose (Debian package) not installed"
)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_docker_compose_merges_the_layout_like_the_checks_do(layout: str) -> None:
    """Cross-check the merge done by the tests against compose's own (`docker-compose config`, no daemon)."""
    spec = LAYOUTS[layout]
    args = [a for f in spec.compose_files for a in ("-f", str(f))]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MINICPMO_", "COMPOSE_"))}
    proc = subprocess.run(
        ["docker-compose", *args, "config"], capture_output=True, text=True, timeout=60, cwd=REPO, env=env
    )
    assert proc.returncode == 0, proc.stderr
    merged = yaml.safe_load(proc.stdout)
    assert check_compose_layout(merged, load_profile(spec.profile), f"{spec.profile}.yaml") == []


# ------------------------------------------------------------------------------------------------------
# Negative cases


def test_compose_typo_fails_the_schema(tmp_path: Path) -> None:
    text = (REPO / "docker-compose.yml").read_text()
    typo = tmp_path / "docker-compose.yml"
    typo.write_text(text.replace("    healthcheck:\n", "    healthchek:\n", 1))
    problems = validate_compose_schema([typo])
    assert any("healthchek" in p for p in problems), problems
    wrong_type = tmp_path / "override.yml"
    wrong_type.write_text(
        (REPO / "compose" / "3gpu.yml").read_text().replace('device_ids: ["2"]', "device_ids: 2")
    )
    assert validate_compose_schema([wrong_type]) != []


def test_compose_yaml_style_problem_fails_yamllint(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yml"
    bad.write_text("services:\n  thinker:\n     image: x   \n")  # 5-space indent, trailing spaces
    problems = yamllint_problems([bad])
    assert any("indentation" in p for p in problems) and any("trailing" in p for p in problems), problems


def test_wrong_gpu_in_a_layout_is_caught() -> None:
    spec = LAYOUTS["2gpu"]
    config = compose_config(spec.compose_files)
    broken = copy.deepcopy(config)
    broken["services"]["code2wav"]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] = ["0"]
    problems = check_compose_layout(broken, load_profile(spec.profile), f"{spec.profile}.yaml")
    assert any("code2wav" in p and "GPUs [0]" in p for p in problems), problems
    # The 1-GPU files checked against the 3-GPU profile disagree on every stage but the thinker.
    one = compose_config(LAYOUTS["1gpu"].compose_files)
    problems = check_compose_layout(one, load_profile("minicpmo_4_5_3gpu"), "minicpmo_4_5_3gpu.yaml")
    assert any(p.startswith("talker: GPUs") for p in problems) and any(
        p.startswith("code2wav: GPUs") for p in problems
    )


def test_health_check_on_the_wrong_port_is_caught() -> None:
    spec = LAYOUTS["3gpu"]
    config = compose_config(spec.compose_files)
    config["services"]["talker"]["healthcheck"]["test"][-1] = "50051"
    problems = check_compose_layout(config, load_profile(spec.profile), f"{spec.profile}.yaml")
    assert any("talker" in p and "healthcheck" in p for p in problems), problems


def test_mps_add_on_makes_every_gpu_stage_a_client_of_its_daemon() -> None:
    config = compose_config(LAYOUTS["1gpu-mps"].compose_files)
    services = config["services"]
    daemon = services["mps"]
    assert daemon.get("ipc") == "host"
    assert "nvidia-cuda-mps-control -f" in " ".join(str(a) for a in daemon["entrypoint"])
    pipe = _environment_of(daemon)["CUDA_MPS_PIPE_DIRECTORY"]
    daemon_volumes = {str(v).split(":")[0] for v in daemon.get("volumes") or []}
    for stage in STAGES:
        svc = services[stage]
        assert svc.get("ipc") == "host", stage
        assert _environment_of(svc).get("CUDA_MPS_PIPE_DIRECTORY") == pipe, stage
        assert daemon_volumes & {str(v).split(":")[0] for v in svc.get("volumes") or []}, stage
    assert "mps" not in compose_config(LAYOUTS["1gpu"].compose_files)["services"]


def _environment_of(svc: dict) -> dict[str, str]:
    env = svc.get("environment") or {}
    if isinstance(env, list):
        return dict(str(e).split("=", 1) for e in env)
    return {str(k): str(v) for k, v in env.items()}
