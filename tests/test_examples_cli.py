"""Every example and demo starts from a fresh shell the way its doc runs it: ``--help`` exits 0.

A fresh shell means the repository root as the working directory and no ``PYTHONPATH``: a script run by
path (``python examples/online_serving/minicpmo/daily_omni.py``) sees its own folder first on
``sys.path``, not the repository, so one that imports ``examples.*`` must put the root there itself. Each
script with a ``__main__`` block runs by path; each package with a ``__main__.py`` runs both as
``python -m examples....`` (how docs/*.md run them) and by its folder's path; the shell wrappers run with
this interpreter as their ``PYTHON``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy_checks import REPO

EXAMPLES = REPO / "examples"


def _fresh_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["OPENBLAS_NUM_THREADS"] = "1"
    return env


def _scripts() -> list[Path]:
    return sorted(
        p
        for p in EXAMPLES.rglob("*.py")
        if p.name != "__main__.py" and 'if __name__ == "__main__":' in p.read_text(encoding="utf-8")
    )


def _packages() -> list[Path]:
    return sorted(p.parent for p in EXAMPLES.rglob("__main__.py"))


def _commands() -> list[tuple[str, list[str]]]:
    found: list[tuple[str, list[str]]] = []
    for script in _scripts():
        rel = script.relative_to(REPO).as_posix()
        found.append((rel, [sys.executable, rel, "--help"]))
    for package in _packages():
        rel = package.relative_to(REPO).as_posix()
        found.append((f"-m {rel}", [sys.executable, "-m", rel.replace("/", "."), "--help"]))
        found.append((rel, [sys.executable, rel, "--help"]))
    return found


def test_the_examples_are_all_found() -> None:
    names = {name for name, _ in _commands()}
    assert {
        "examples/online_serving/minicpmo/gradio_demo.py",
        "examples/online_serving/minicpmo/daily_omni.py",
        "examples/realtime_duplex_demo.py",
        "-m examples/online_serving/minicpmo/omni_duplex_eval",
        "-m examples/online_serving/minicpmo/realtime_web",
    } <= names


@pytest.mark.parametrize(("name", "argv"), _commands(), ids=[name for name, _ in _commands()])
def test_example_help_runs_from_a_fresh_shell(name: str, argv: list[str]) -> None:
    out = subprocess.run(argv, cwd=REPO, env=_fresh_env(), capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, f"{name}: exit {out.returncode}\n{out.stderr[-2000:]}"
    assert "usage:" in out.stdout.lower(), out.stdout[-500:]


def test_the_gradio_wrapper_passes_help_on() -> None:
    env = _fresh_env() | {"PYTHON": sys.executable}
    out = subprocess.run(
        ["bash", "examples/online_serving/minicpmo/run_gradio_demo.sh", "--help"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--api-base" in out.stdout
