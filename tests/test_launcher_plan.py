"""The launcher's child plan: each stage lands on the profile's device, without starting any process."""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

import pytest

from gateway.launcher import ChildSpec, Supervisor, build_parser, pick_free_stage_ports, plan_children
from services.common.deploy_profile import STAGE_SETTINGS_ENV, ProfileError, load_profile
from services.common.gpu_sharing import PIPE_ENV


def _arg(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_2gpu_profile_places_each_stage_on_its_gpu() -> None:
    profile = load_profile("minicpmo_4_5_2gpu")
    assert profile.stage("thinker").devices == ("cuda:0",)
    assert profile.stage("talker").devices == ("cuda:1",)
    assert profile.stage("code2wav").devices == ("cuda:1",)
    children = plan_children(profile, "/ckpt", "/run/profile.yaml", 8099, python="py")
    by_name = {c.name: c for c in children}
    assert list(by_name) == ["thinker-0", "talker-0", "code2wav-0", "gateway"]
    expected_gpu = {"thinker-0": "0", "talker-0": "1", "code2wav-0": "1"}
    for name, gpu in expected_gpu.items():
        child = by_name[name]
        stage = name.split("-")[0]
        assert child.argv[:3] == ["py", "-m", f"services.{stage}"]
        assert child.env["CUDA_VISIBLE_DEVICES"] == gpu
        assert _arg(child.argv, "--device") == "cuda:0"  # the one GPU the process can see
        assert _arg(child.argv, "--checkpoint") == "/ckpt"
        assert _arg(child.argv, "--port") == str(profile.stage(stage).port)
        assert f'"name": "{stage}"' in child.env[STAGE_SETTINGS_ENV]
    assert _arg(by_name["thinker-0"].argv, "--max-num-seqs") == "8"
    assert _arg(by_name["talker-0"].argv, "--dtype") == "bfloat16"
    for name, fraction in {"thinker-0": 0.9, "talker-0": 0.4, "code2wav-0": 0.5}.items():
        assert float(_arg(by_name[name].argv, "--memory-fraction")) == fraction
        assert json.loads(by_name[name].env[STAGE_SETTINGS_ENV])["memory_fraction"] == fraction
    gw = by_name["gateway"]
    assert gw.argv[:3] == ["py", "-m", "gateway"]
    assert _arg(gw.argv, "--thinker-addr") == "127.0.0.1:50051"
    assert _arg(gw.argv, "--talker-addr") == "127.0.0.1:50052"
    assert _arg(gw.argv, "--code2wav-addr") == "127.0.0.1:50053"
    assert _arg(gw.argv, "--deploy-config") == "/run/profile.yaml"
    assert gw.env["CUDA_VISIBLE_DEVICES"] == ""


def test_8x4090_replicas_get_one_gpu_and_port_each() -> None:
    profile = load_profile("minicpmo_4_5_8x4090")
    children = plan_children(profile, "/ckpt", "/p.yaml", 8099, python="py")
    thinkers = [c for c in children if c.stage == "thinker"]
    assert [c.env["CUDA_VISIBLE_DEVICES"] for c in thinkers] == ["0", "1", "2", "3"]
    assert [c.env["CUDA_VISIBLE_DEVICES"] for c in children if c.stage == "talker"] == ["4", "5"]
    assert [c.env["CUDA_VISIBLE_DEVICES"] for c in children if c.stage == "code2wav"] == ["6", "7"]
    gw = children[-1]
    assert _arg(gw.argv, "--thinker-addr") == ",".join(f"127.0.0.1:{p}" for p in (50051, 50061, 50071, 50081))


def test_prefix_caching_profile_key_reaches_the_thinker_and_only_it() -> None:
    off = load_profile("cpu").with_overrides({"thinker": {"prefix_caching": False}})
    children = {c.stage: c for c in plan_children(off, "/ckpt", "/p.yaml", 8099, python="py") if c.stage}
    assert "--no-prefix-caching" in children["thinker"].argv
    assert json.loads(children["thinker"].env[STAGE_SETTINGS_ENV])["prefix_caching"] is False
    assert not any("prefix-caching" in a for a in children["talker"].argv)
    with pytest.raises(ProfileError, match="prefix caching is a thinker setting"):
        load_profile("cpu").with_overrides({"talker": {"prefix_caching": False}})
    with pytest.raises(ProfileError, match="prefix_caching"):
        load_profile("cpu").with_overrides({"thinker": {"prefix_caching": "maybe"}})


def test_kv_cache_profile_key_reaches_the_thinker_and_only_it() -> None:
    fp8 = load_profile("cpu").with_overrides({"thinker": {"kv_cache": "fp8"}})
    children = {c.stage: c for c in plan_children(fp8, "/ckpt", "/p.yaml", 8099, python="py") if c.stage}
    assert _arg(children["thinker"].argv, "--kv-cache") == "fp8"
    assert json.loads(children["thinker"].env[STAGE_SETTINGS_ENV])["kv_cache"] == "fp8"
    assert "--kv-cache" not in children["talker"].argv
    with pytest.raises(ProfileError, match="the KV cache format is a thinker setting"):
        load_profile("cpu").with_overrides({"talker": {"kv_cache": "fp8"}})
    with pytest.raises(ProfileError, match="kv_cache"):
        load_profile("cpu").with_overrides({"thinker": {"kv_cache": "int4"}})


def test_single_gpu_profile_hands_every_stage_its_share_and_limits() -> None:
    profile = load_profile("minicpmo_4_5")
    children = {c.stage: c for c in plan_children(profile, "/ckpt", "/p.yaml", 8099, python="py") if c.stage}
    expected = {
        "thinker": [
            "--dtype",
            "bfloat16",
            "--max-num-seqs",
            "24",
            "--max-context",
            "40960",
            "--duplex-window",
            "basic",
            "--duplex-window-high",
            "8000",
            "--duplex-window-low",
            "6000",
            "--weights",
            "bf16",
            "--kv-cache",
            "bf16",
            "--prefix-caching",
            "--no-whisper-graphs",
            "--memory-fraction",
            "0.4",
        ],
        "talker": ["--dtype", "bfloat16", "--max-streams", "16", "--memory-fraction", "0.08"],
        "code2wav": ["--max-batch", "8", "--memory-fraction", "0.4"],
    }
    for stage, flags in expected.items():
        child = children[stage]
        assert child.argv[-len(flags) :] == flags
        settings = json.loads(child.env[STAGE_SETTINGS_ENV])
        assert settings["name"] == stage and settings["memory_fraction"] == float(flags[-1])
        assert settings["max_num_seqs"] == int(
            flags[
                flags.index(
                    "--max-num-seqs"
                    if stage == "thinker"
                    else "--max-streams"
                    if stage == "talker"
                    else "--max-batch"
                )
                + 1
            ]
        )
    assert json.loads(children["talker"].env[STAGE_SETTINGS_ENV])["codec"]["first_window_frames"] == 10


def test_stage_without_a_memory_share_gets_no_flag() -> None:
    children = plan_children(load_profile("cpu"), "/ckpt", "/p.yaml", 8099, python="py")
    assert all("--memory-fraction" not in c.argv for c in children)


def test_device_cpu_override_hides_gpus() -> None:
    profile = load_profile("minicpmo_4_5_2gpu").with_device("cpu")
    for child in plan_children(profile, Path("/ckpt"), "/p.yaml", 9000, python="py"):
        if child.stage is not None:
            assert _arg(child.argv, "--device") == "cpu"
        assert child.env["CUDA_VISIBLE_DEVICES"] == ""


def test_auto_ports_are_distinct_and_leave_metrics_ports_free() -> None:
    profile = load_profile("minicpmo_4_5_8x4090")
    ports = pick_free_stage_ports(profile)
    flat = [p for stage in ports.values() for p in stage]
    assert len(flat) == 8 and len(set(flat)) == 8
    assert not set(flat) & {p + 1000 for p in flat}
    children = plan_children(profile, "/c", "/p.yaml", 8099, python="py", stage_ports=ports)
    assert [c.port for c in children if c.stage == "thinker"] == ports["thinker"]


def test_cli_flags() -> None:
    args = build_parser().parse_args(
        ["--deploy-config", "cpu", "--stage-overrides", "{}", "--device", "cpu", "--port", "8100"]
    )
    assert (args.deploy_config, args.device, args.port) == ("cpu", "cpu", 8100)


@pytest.mark.slow  # imports every stage's server module (torch) in a subprocess
def test_planned_flags_exist_in_every_stage_cli() -> None:
    """Each flag the launcher passes is one the stage CLI accepts (guards against renamed flags)."""
    import subprocess
    import sys

    profile = load_profile("minicpmo_4_5").with_overrides(
        {
            "thinker": {
                "kernel_table": "/t/skinny.json",
                "fp8_table": "/t/fp8.json",
                "max_step_tokens": 128,
                "whisper_graphs": True,
            }
        }
    )
    children = plan_children(profile, "/ckpt", "/p.yaml", 8099, python=sys.executable)
    for child in children:
        helptext = subprocess.run(
            child.argv[:3] + ["--help"], capture_output=True, text=True, timeout=120
        ).stdout
        flags = [a for a in child.argv[3:] if a.startswith("--")]
        missing = [f for f in flags if f not in helptext]
        assert not missing, f"{child.name}: flags {missing} not in `{' '.join(child.argv[1:3])} --help`"


def test_supervisor_restarts_a_dead_child_at_once_then_with_backoff_then_gives_up(tmp_path: Path) -> None:
    """Real (tiny) child processes that die at once: the first restart is immediate (in the same
    supervise pass), then 1, 2, 4, 8 s, and at the sixth quick death it gives up."""
    child = ChildSpec("flaky-0", "code2wav", [sys.executable, "-c", "raise SystemExit(3)"])
    sup = Supervisor([child], tmp_path)
    logs: list[str] = []

    def log(message: str, **_: object) -> None:
        logs.append(message)

    sup.start(child)
    sup.procs["flaky-0"].wait(30)
    first_pid = sup.procs["flaky-0"].pid
    sup.supervise(time.monotonic(), log=log)
    assert sup.procs["flaky-0"].pid != first_pid and "flaky-0" not in sup.restart_due
    assert "restarting now" in logs[0] and "restarted flaky-0" in logs[1]
    delays = []
    for _ in range(4):
        sup.procs["flaky-0"].wait(30)
        now = time.monotonic()
        sup.supervise(now, log=log)
        delays.append(round(sup.restart_due["flaky-0"] - now))
        sup.supervise(now + delays[-1] - 0.01, log=log)  # not yet due: nothing happens
        assert "flaky-0" in sup.restart_due
        sup.supervise(sup.restart_due["flaky-0"], log=log)  # due: started again
    assert delays == [1, 2, 4, 8] and sup.restarts["flaky-0"] == 5
    assert "exited with code 3" in logs[0]
    sup.procs["flaky-0"].wait(30)
    with pytest.raises(RuntimeError, match="giving up"):
        sup.supervise(time.monotonic(), log=log)
    # a child that ran for a while before dying starts its backoff from scratch
    sup.quick_deaths.clear()
    sup.start(child)
    sup.procs["flaky-0"].wait(30)
    sup.started_at["flaky-0"] -= 3600
    restarts = sup.restarts["flaky-0"]
    sup.supervise(time.monotonic(), log=log)
    assert "flaky-0" not in sup.restart_due and sup.restarts["flaky-0"] == restarts + 1  # at once again
    sup.procs["flaky-0"].wait(30)


_SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]
_KILLED = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"]
_REFUSED = [
    sys.executable,
    "-c",
    "print('RuntimeError: ... Error 807: MPS server is not ready to accept new MPS client requests'); "
    "raise SystemExit(1)",
]


def _group(tmp_path: Path, first: list[str], pipe: str | None) -> tuple[Supervisor, list[ChildSpec]]:
    env = {PIPE_ENV: pipe} if pipe else {}
    children = [
        ChildSpec("code2wav-0", "code2wav", first, env=dict(env)),
        ChildSpec("thinker-0", "thinker", _SLEEPER, env=dict(env)),
        ChildSpec("talker-0", "talker", _SLEEPER, env=dict(env)),
        ChildSpec("gateway", None, _SLEEPER),
    ]
    sup = Supervisor(children, tmp_path)
    for child in children:
        sup.start(child)
    return sup, children


def _stop_all(sup: Supervisor) -> None:
    sup.stop(gateway_timeout_s=5, stage_timeout_s=5)


@pytest.mark.parametrize("first", [_KILLED, _REFUSED], ids=["killed-by-a-signal", "context-refused"])
def test_a_dead_mps_client_restarts_every_client_of_its_server(tmp_path: Path, first: list[str]) -> None:
    """A stage that dies by a signal, or whose CUDA context was refused, under a shared MPS server: the
    server takes no new client until all of its clients have exited, so the launcher stops the other
    stage clients of that server and restarts them with it; the gateway (no MPS client) is left alone,
    and the siblings' restarts are not quick deaths of their own."""
    sup, _ = _group(tmp_path, first, "/tmp/mps-pipe")
    try:
        sup.procs["code2wav-0"].wait(30)
        before = {name: proc.pid for name, proc in sup.procs.items()}
        logs: list[str] = []
        sup.supervise(time.monotonic(), log=lambda m, **_: logs.append(m))  # one pass restarts all three
        after = {name: proc.pid for name, proc in sup.procs.items()}
        for name in ("code2wav-0", "thinker-0", "talker-0"):
            assert after[name] != before[name], name
            assert sup.restarts[name] == 1
        assert after["gateway"] == before["gateway"] and "gateway" not in sup.restarts
        assert sup.quick_deaths == {"code2wav-0": 1}
        assert any("stopping thinker-0, talker-0" in m for m in logs), logs
        assert sup.procs["thinker-0"].poll() is None and sup.procs["talker-0"].poll() is None
    finally:
        _stop_all(sup)


def test_a_stage_that_exits_normally_or_without_mps_restarts_alone(tmp_path: Path) -> None:
    """Without MPS a signal death restarts only that stage; under MPS an ordinary exit (code 3, no
    refused context in its log) restarts only that stage too."""
    for first, pipe in ((_KILLED, None), ([sys.executable, "-c", "raise SystemExit(3)"], "/tmp/mps-pipe")):
        sup, _ = _group(tmp_path, first, pipe)
        try:
            sup.procs["code2wav-0"].wait(30)
            assert sup.procs["code2wav-0"].returncode == (-signal.SIGKILL if pipe is None else 3)
            before = {name: proc.pid for name, proc in sup.procs.items()}
            sup.supervise(time.monotonic(), log=lambda m, **_: None)
            after = {name: proc.pid for name, proc in sup.procs.items()}
            assert after["code2wav-0"] != before["code2wav-0"]
            assert {n: after[n] for n in ("thinker-0", "talker-0", "gateway")} == {
                n: before[n] for n in ("thinker-0", "talker-0", "gateway")
            }
        finally:
            _stop_all(sup)
