"""The GPU recipes in bench/gpu/ (run by hand on a GPU host, so nothing else exercises them here): each
parses as bash, sources the shared env.sh, runs only bench modules that exist with flags those modules
define, and is documented in bench/README.md; every recipe BENCHMARKS.md names exists."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GPU = ROOT / "bench" / "gpu"
RECIPES = sorted(p for p in GPU.glob("*.sh") if p.name not in ("env.sh", "wheels.sh"))  # helpers, not recipes


def _module_source(module: str) -> str:
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin, f"no module {module}"
    origin = Path(spec.origin)
    if origin.name == "__init__.py" and (origin.parent / "__main__.py").exists():
        origin = origin.parent / "__main__.py"
    text = origin.read_text(encoding="utf-8")
    if module in ("bench.e2e", "bench.realtime_duplex", "bench.audio_speech", "bench.prefix_cache"):
        text += (ROOT / "bench" / "launch.py").read_text(encoding="utf-8")  # shared pipeline flags
    return text


def test_there_are_recipes() -> None:
    assert {p.name for p in RECIPES} >= {"thinker.sh", "talker.sh", "code2wav.sh", "e2e.sh", "duplex.sh"}


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
@pytest.mark.parametrize("recipe", sorted(GPU.glob("*.sh")), ids=lambda p: p.name)
def test_recipe_parses(recipe: Path) -> None:
    subprocess.run(["bash", "-n", str(recipe)], check=True)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_recipe_uses_existing_modules_and_flags(recipe: Path) -> None:
    text = recipe.read_text(encoding="utf-8")
    assert "source bench/gpu/env.sh" in text
    # one logical command per `-m module ...` (continuation lines joined)
    joined = re.sub(r"\\\n\s*", " ", text)
    calls = re.findall(r"-m (bench\.[\w.]+)([^\n>]*)", joined)
    assert calls or "run_e2e" in text, f"{recipe.name} runs no bench module"
    for module, args in calls:
        source = _module_source(module)
        for flag in re.findall(r"(?<![\w=-])(--[a-z][\w-]*)", args):
            assert f'"{flag}"' in source, f"{recipe.name}: {module} has no {flag}"


def test_env_helper_e2e_flags_exist() -> None:
    text = (GPU / "env.sh").read_text(encoding="utf-8")
    joined = re.sub(r"\\\n\s*", " ", text)
    args = re.search(r"-m bench\.e2e([^\n>]*)", joined)
    assert args is not None
    source = _module_source("bench.e2e")
    for flag in re.findall(r"(?<![\w=-])(--[a-z][\w-]*)", args.group(1)):
        assert f'"{flag}"' in source, f"env.sh run_e2e: bench.e2e has no {flag}"


def test_recipes_are_documented_and_cited_recipes_exist() -> None:
    readme = (ROOT / "bench" / "README.md").read_text(encoding="utf-8")
    for recipe in sorted(GPU.glob("*.sh")):
        assert f"bench/gpu/{recipe.name}" in readme, f"bench/README.md does not describe {recipe.name}"
    cited = set(re.findall(r"bench/gpu/([\w.]+)", (ROOT / "BENCHMARKS.md").read_text(encoding="utf-8")))
    assert cited, "BENCHMARKS.md names no recipe"
    for name in cited:
        assert (GPU / name).exists(), f"BENCHMARKS.md cites bench/gpu/{name}, which does not exist"


def test_duplex_bench_makes_room_for_its_largest_level() -> None:
    """24 sessions on the 16-session profile: the launched gateway admits 24; 16 leaves the profile as is."""
    from bench.realtime_duplex import with_session_room
    from services.common.deploy_profile import load_profile

    profile = load_profile("configs/deploy/minicpmo_4_5.yaml")
    assert profile.gateway.max_realtime_sessions == 16
    assert with_session_room(profile, 16) is profile
    assert with_session_room(profile, 24).gateway.max_realtime_sessions == 24
