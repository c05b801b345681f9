"""Container images without a Docker daemon: the Dockerfile's targets and rules (non-root, CUDA base for GPU
stages, no build-time weight download, health checks), the .dockerignore, and the two small programs the
images run besides the services: the profile-aware entrypoint and the gRPC/HTTP health probes, exercised
against real servers on loopback."""

from __future__ import annotations

import http.server
import importlib.util
import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.common.deploy_profile import STAGE_SETTINGS_ENV, ProfileError, load_profile
from tests.deploy_checks import REPO

DOCKERFILE = REPO / "Dockerfile"
STAGE_TARGETS = [f"{s}-{v}" for s in ("thinker", "talker", "code2wav") for v in ("cuda", "cpu")]


def _load_script(name: str) -> ModuleType:
    path = REPO / "docker" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"docker_{name}", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _stages() -> dict[str, tuple[str, list[str]]]:
    """Dockerfile build stages: name -> (FROM reference, instruction lines), continuation lines joined."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    stages: dict[str, tuple[str, list[str]]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.match(r"FROM\s+(\S+)\s+AS\s+(\S+)$", line, re.IGNORECASE)
        if m:
            current = []
            stages[m.group(2)] = (m.group(1), current)
        elif current is not None:
            current.append(line)
    return stages


def _chain(stages: dict[str, tuple[str, list[str]]], target: str) -> list[str]:
    """Instructions that apply to ``target``, base stage first."""
    base, lines = stages[target]
    return (_chain(stages, base) if base in stages else []) + lines


def _base_image(stages: dict[str, tuple[str, list[str]]], target: str) -> str:
    base = stages[target][0]
    return _base_image(stages, base) if base in stages else base


def test_dockerfile_has_every_target() -> None:
    assert set(STAGE_TARGETS + ["gateway"]) <= set(_stages())


@pytest.mark.parametrize("target", STAGE_TARGETS + ["gateway"])
def test_target_runs_unprivileged_with_health_check(target: str) -> None:
    stages = _stages()
    chain = _chain(stages, target)
    users = [line.split()[1] for line in chain if line.upper().startswith("USER ")]
    assert users and users[-1].split(":")[0] not in ("0", "root"), f"{target} runs as {users}"
    assert any(line.upper().startswith("HEALTHCHECK ") for line in chain), target
    assert any(line.upper().startswith("ENTRYPOINT ") and "entrypoint.py" in line for line in chain)
    probe = "http_health_probe.py" if target == "gateway" else "grpc_health_probe.py"
    assert any(probe in line for line in chain if line.upper().startswith("HEALTHCHECK")), target


@pytest.mark.parametrize("target", STAGE_TARGETS + ["gateway"])
def test_base_image_fits_the_variant(target: str) -> None:
    stages = _stages()
    base = _base_image(stages, target)
    arg_defaults = dict(re.findall(r"^ARG (\w+)=(\S+)$", DOCKERFILE.read_text(), re.MULTILINE))
    image = arg_defaults.get(base.strip("${}"), base)
    if target.endswith("-cuda"):
        assert image.startswith("nvidia/cuda:") and "runtime" in image, image
    else:
        assert "slim" in image, f"{target}: {image}"


def test_no_weights_enter_an_image() -> None:
    text = DOCKERFILE.read_text()
    runs = " ".join(
        line for line in re.sub(r"\\\n", " ", text).splitlines() if line.strip().startswith("RUN")
    )
    for forbidden in ("huggingface-cli", "hf download", "snapshot_download", "wget ", "curl ", "git lfs"):
        assert forbidden not in runs, forbidden
    copies = [line for line in text.splitlines() if line.startswith("COPY")]
    assert not any("checkpoint" in line or "models" in line for line in copies), copies
    ignored = (REPO / ".dockerignore").read_text().split()
    for pattern in (".venv", ".git", "checkpoints", "*.safetensors", "tests"):
        assert pattern in ignored, pattern


def test_stage_command_uses_the_stage_cli_and_default_ports() -> None:
    stages = _stages()
    for stage, port in (("thinker", 50051), ("talker", 50052), ("code2wav", 50053)):
        for variant in ("cuda", "cpu"):
            chain = _chain(stages, f"{stage}-{variant}")
            env = " ".join(line for line in chain if line.startswith("ENV"))
            assert f"MINICPMO_STAGE={stage}" in env and f"MINICPMO_GRPC_PORT={port}" in env
            assert f"MINICPMO_DEVICE={variant}" in env
            cmd = [line for line in chain if line.startswith("CMD")][-1]
            assert "python -m services.${MINICPMO_STAGE}" in cmd and "--port ${MINICPMO_GRPC_PORT}" in cmd


# ------------------------------------------------------------------------------------------------------
# entrypoint.py


def test_entrypoint_hands_the_stage_its_profile_section(tmp_path: Path) -> None:
    entry = _load_script("entrypoint")
    profile_file = REPO / "configs" / "deploy" / "minicpmo_4_5_2gpu.yaml"
    env = entry.prepare_environment(
        {"MINICPMO_DEPLOY_PROFILE": str(profile_file), "MINICPMO_STAGE": "talker"}
    )
    settings = json.loads(env[STAGE_SETTINGS_ENV])
    expected = load_profile(profile_file).stage("talker")
    assert settings == json.loads(expected.settings_json())
    assert settings["name"] == "talker" and settings["memory_fraction"] == 0.4


def test_entrypoint_leaves_explicit_settings_and_plain_runs_alone() -> None:
    entry = _load_script("entrypoint")
    assert entry.prepare_environment({"MINICPMO_STAGE": "thinker"}) == {"MINICPMO_STAGE": "thinker"}
    given = {"MINICPMO_DEPLOY_PROFILE": "cpu", "MINICPMO_STAGE": "thinker", STAGE_SETTINGS_ENV: "{}"}
    assert entry.prepare_environment(given) == given
    gateway = {"MINICPMO_DEPLOY_PROFILE": "cpu"}
    assert entry.prepare_environment(gateway) == gateway


def test_entrypoint_refuses_a_broken_profile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    entry = _load_script("entrypoint")
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\nstages:\n  thinker: {devices: [gpu0]}\n  talker: {}\n  code2wav: {}\n")
    with pytest.raises(ProfileError, match="devices"):
        entry.prepare_environment({"MINICPMO_DEPLOY_PROFILE": str(bad), "MINICPMO_STAGE": "thinker"})
    monkeypatch.setenv("MINICPMO_DEPLOY_PROFILE", str(bad))
    monkeypatch.setenv("MINICPMO_STAGE", "thinker")
    monkeypatch.delenv(STAGE_SETTINGS_ENV, raising=False)
    assert entry.main(["true"]) == 2
    assert "deploy profile rejected" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------------
# health probes


@pytest.fixture()
def health_server() -> Iterator[tuple[int, health.HealthServicer]]:
    from concurrent import futures

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield port, servicer
    finally:
        server.stop(None)


def test_grpc_probe_follows_the_serving_status(health_server: tuple[int, health.HealthServicer]) -> None:
    probe = _load_script("grpc_health_probe")
    port, servicer = health_server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    assert probe.main(["--port", str(port)]) == 0
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)  # loading or draining
    assert probe.main(["--port", str(port)]) == 1
    assert probe.main(["--port", str(port), "--service", "minicpmo.v1.Nope"]) == 1  # NOT_FOUND


def test_grpc_probe_fails_fast_without_a_server(monkeypatch: pytest.MonkeyPatch) -> None:
    probe = _load_script("grpc_health_probe")
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free_port = s.getsockname()[1]
    assert probe.main(["--port", str(free_port), "--timeout", "1"]) == 1
    monkeypatch.setenv("MINICPMO_STAGE", "code2wav")
    monkeypatch.delenv("MINICPMO_GRPC_PORT", raising=False)
    assert probe.default_port() == 50053
    monkeypatch.setenv("MINICPMO_GRPC_PORT", "6000")
    assert probe.default_port() == 6000


def test_http_probe_follows_the_status_code() -> None:
    probe = _load_script("http_health_probe")
    status = {"code": 200}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server API)
            self.send_response(status["code"] if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        port = str(server.server_address[1])
        assert probe.main(["--port", port]) == 0
        status["code"] = 503  # a stage is down
        assert probe.main(["--port", port]) == 1
        assert probe.main(["--port", port, "--path", "/missing"]) == 1
    finally:
        server.shutdown()
        server.server_close()


def test_entrypoint_turns_the_tls_environment_into_flags() -> None:
    """compose/tls.yml and the Helm chart hand TLS files over as environment variables; the services take
    flags only, so the entrypoint appends them (exec form and the Dockerfile's ``sh -c`` commands)."""
    entry = _load_script("entrypoint")
    env = {
        "MINICPMO_TLS_CERT": "/tls/stage.pem",
        "MINICPMO_TLS_KEY": "/tls/stage key.pem",
        "MINICPMO_TLS_CLIENT_CA": "/tls/ca.pem",
        "MINICPMO_STAGE_TLS_CA": "/tls/ca.pem",
        "MINICPMO_STAGE_TLS_CERT": "/tls/gw.pem",
    }
    stage = ["python", "-m", "services.talker", "--checkpoint", "/models", "--tls-key", "/given.pem"]
    assert entry.command_with_tls(stage, env) == [
        *stage, "--tls-cert", "/tls/stage.pem", "--tls-client-ca", "/tls/ca.pem",
    ]  # fmt: skip
    gateway = ["python", "-m", "gateway", "--port", "8099"]
    assert entry.command_with_tls(gateway, env) == [
        *gateway, "--stage-tls-ca", "/tls/ca.pem", "--stage-tls-cert", "/tls/gw.pem",
    ]  # fmt: skip
    script = ["sh", "-c", "exec python -m services.${MINICPMO_STAGE} --port ${MINICPMO_GRPC_PORT}"]
    got = entry.command_with_tls(script, env)
    assert got[:2] == ["sh", "-c"]
    assert got[2].endswith(
        "--tls-cert /tls/stage.pem --tls-key '/tls/stage key.pem' --tls-client-ca /tls/ca.pem"
    )
    assert entry.command_with_tls(stage, {}) == stage
    assert entry.command_with_tls(["true"], env) == ["true"]
