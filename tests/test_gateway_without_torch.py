"""The gateway runs without torch, and its image installs only what it imports.

The gateway forwards tensors' bytes; it never computes with them. Importing torch would cost seconds of
start-up and put CUDA wheels into its image. So: ``gateway.app``, ``gateway.launcher`` and ``gateway``'s
CLI import without torch (checked in a fresh interpreter, where nothing else has loaded it), and every
third-party distribution they load is covered by ``[tool.minicpmo] gateway-dependencies`` of
pyproject.toml, the list the gateway image's venv is built from (``docker/pip-install.sh deps-gateway``),
whenever the full runtime dependencies would have installed it (a module outside those is an optional
import that only the dev venv happens to satisfy, e.g. fastapi's orjson).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from importlib import metadata

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.deploy_checks import REPO

GATEWAY_MODULES = ("gateway.app", "gateway.launcher", "gateway.__main__")
# Never in the gateway image: torch and what only the model stages use.
HEAVY = {"torch", "torchaudio", "transformers", "triton", "safetensors", "tokenizers", "librosa", "scipy"}

_PROBE = """
import importlib, json, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
print(json.dumps(sorted({m.split(".")[0] for m in sys.modules})))
"""


def _loaded_top_modules() -> set[str]:
    """Top-level modules a fresh interpreter holds after importing the gateway's entry modules."""
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, *GATEWAY_MODULES],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def _gateway_lists() -> tuple[list[str], list[str]]:
    with open(REPO / "pyproject.toml", "rb") as fh:
        tool = tomllib.load(fh)["tool"]["minicpmo"]
    return tool["gateway-dependencies"], tool["gateway-no-deps"]


def _closure(requirements: list[str]) -> set[str]:
    """Canonical names of the distributions ``requirements`` install (with their dependencies, markers
    evaluated for this interpreter, extras not requested)."""
    seen: set[str] = set()
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in seen or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        seen.add(name)
        try:
            requires = metadata.requires(req.name) or []
        except metadata.PackageNotFoundError:
            continue
        todo.extend(Requirement(r) for r in requires)
    return seen


def test_the_gateway_imports_no_torch() -> None:
    code = "import sys, gateway.app, gateway.launcher; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=120)


def test_the_gateway_image_dependencies_cover_what_it_imports() -> None:
    deps, no_deps = _gateway_lists()
    with open(REPO / "pyproject.toml", "rb") as fh:
        project = tomllib.load(fh)["project"]["dependencies"]
    assert set(deps + no_deps) <= set(project), "the gateway list repeats [project].dependencies' entries"
    installed = _closure(deps) | {canonicalize_name(Requirement(r).name) for r in no_deps}
    assert not installed & HEAVY, sorted(installed & HEAVY)
    full = _closure(project)

    loaded = _loaded_top_modules() - set(sys.stdlib_module_names) - {"gateway", "services"}
    owners = metadata.packages_distributions()
    missing: dict[str, list[str]] = {}
    for module in sorted(loaded):
        if module.startswith("_") or module not in owners:
            continue  # extension internals of the interpreter / a distribution already counted
        dists = {canonicalize_name(d) for d in owners[module]}
        if dists & full and not dists & installed:  # outside ``full``: an optional import (dev venv only)
            missing[module] = sorted(dists)
    assert missing == {}, f"gateway imports modules its image would not install: {missing}"


def test_the_gateway_image_builds_from_the_gateway_list() -> None:
    """The Dockerfile's gateway build stage installs the gateway list and no torch index."""
    text = re.sub(r"\\\n", " ", (REPO / "Dockerfile").read_text())
    stage = text.split("AS build-gateway", 1)[1].split("\nFROM ", 1)[0]
    assert "pip-install.sh deps-gateway" in stage and "pip-install.sh project-gateway" in stage
    assert "TORCH_INDEX_URL" not in stage
