"""GPU sharing (services/common/gpu_sharing.py, gateway.launcher.share_gpus): which profiles share a GPU,
when the launcher starts a private MPS daemon, what the stage children get, and the fallbacks. The daemon
is a stand-in script on PATH that records how it was called (no GPU here); the real one ran on the H200
(BENCHMARKS.md, "GPU sharing: MPS")."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

import pytest

from gateway.launcher import plan_children, share_gpus
from services.common.deploy_profile import load_profile
from services.common.gpu_sharing import PIPE_ENV, shared_gpus, start_sharing


def _fake_daemon(bin_dir: Path, record: Path) -> None:
    """An ``nvidia-cuda-mps-control`` that appends its argv, its pipe directory and its stdin to ``record``."""
    script = bin_dir / "nvidia-cuda-mps-control"
    script.write_text(
        "#!/bin/sh\n"
        f'echo "argv=$* pipe=${PIPE_ENV}" >> {record}\n'
        f'if [ "$1" != "-d" ]; then cat >> {record}; fi\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)


@pytest.fixture
def fake_mps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    record = tmp_path / "calls.txt"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _fake_daemon(bin_dir, record)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv(PIPE_ENV, raising=False)
    return record


def test_shared_gpus_per_bundled_profile() -> None:
    assert shared_gpus(load_profile("minicpmo_4_5")) == ["cuda:0"]
    assert shared_gpus(load_profile("minicpmo_4_5_2gpu")) == ["cuda:1"]
    assert shared_gpus(load_profile("minicpmo_4_5_3gpu")) == []
    assert shared_gpus(load_profile("cpu")) == []
    assert load_profile("minicpmo_4_5").gpu_sharing == "mps"


def test_mps_profile_makes_the_gpu_stages_clients_of_a_private_daemon(fake_mps: Path, tmp_path: Path) -> None:
    profile = load_profile("minicpmo_4_5")
    children = plan_children(profile, tmp_path / "ckpt", tmp_path / "profile.yaml", 8099)
    mode, daemon = share_gpus(profile, children, log=lambda m: None)
    assert daemon is not None and daemon.started
    assert mode.startswith("MPS clients")
    pipe = daemon.env[PIPE_ENV]
    assert Path(pipe).is_dir()
    stages = [c for c in children if c.stage is not None]
    assert len(stages) == 3 and all(c.env[PIPE_ENV] == pipe for c in stages)
    gateway = next(c for c in children if c.stage is None)
    assert PIPE_ENV not in gateway.env  # the gateway has no GPU
    assert fake_mps.read_text().splitlines() == [f"argv=-d pipe={pipe}"]
    daemon.stop()
    daemon.stop()  # a second stop does nothing
    assert fake_mps.read_text().splitlines()[1:] == [f"argv= pipe={pipe}", "quit"]
    assert not Path(pipe).parent.exists()  # its private directory went with it


def test_time_slice_profile_starts_nothing(fake_mps: Path, tmp_path: Path) -> None:
    profile = load_profile("minicpmo_4_5").with_overrides({"gpu_sharing": "time_slice"})
    children = plan_children(profile, tmp_path / "ckpt", tmp_path / "profile.yaml", 8099)
    mode, daemon = share_gpus(profile, children, log=lambda m: None)
    assert daemon is None and "time-slicing cuda:0" in mode
    assert not fake_mps.exists()
    assert all(PIPE_ENV not in c.env for c in children)


def test_one_stage_per_gpu_needs_no_daemon(fake_mps: Path) -> None:
    profile = load_profile("minicpmo_4_5_3gpu").with_overrides({"gpu_sharing": "mps"})
    mode, daemon = start_sharing(profile, log=lambda m: None)
    assert daemon is None and mode == "one stage process per GPU"
    assert start_sharing(load_profile("cpu"), log=lambda m: None) == ("no GPU", None)
    assert not fake_mps.exists()


def test_a_daemon_run_by_the_host_is_used_as_it_is(fake_mps: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PIPE_ENV, "/var/run/host-mps")
    mode, daemon = start_sharing(load_profile("minicpmo_4_5"), log=lambda m: None)
    assert daemon is None and "/var/run/host-mps" in mode
    assert not fake_mps.exists()


def test_without_the_daemon_binary_the_stages_time_slice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing on it
    monkeypatch.delenv(PIPE_ENV, raising=False)
    logged: list[str] = []
    made = set(Path(tempfile.gettempdir()).glob("minicpmo-mps-*"))
    mode, daemon = start_sharing(load_profile("minicpmo_4_5"), log=logged.append)
    assert daemon is None
    assert set(Path(tempfile.gettempdir()).glob("minicpmo-mps-*")) <= made  # no directory left behind
    assert "time-slicing cuda:0" in mode and "not on PATH" in mode
    assert len(logged) == 1 and "nvidia-cuda-mps-control is not on PATH" in logged[0]


def test_gpu_sharing_is_validated() -> None:
    from services.common.deploy_profile import ProfileError

    with pytest.raises(ProfileError, match="gpu_sharing"):
        load_profile("minicpmo_4_5").with_overrides({"gpu_sharing": "shared"})
