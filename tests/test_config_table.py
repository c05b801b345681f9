"""One configuration: the deploy profile, its generated table, and no environment switches.

* docs/config.md is what ``python -m services.common.config_table`` renders from the profile's models
  (a key added to the schema without regenerating the table fails here);
* every environment variable the Python code of ``services/``, ``gateway/`` and ``bench/`` reads is one
  of the few listed in ``config_table.ENVIRONMENT`` (or a benchmark's output folder), found by an AST
  walk that also resolves module-level name constants (``ENV = "X"; os.environ.get(ENV)``);
* the new profile keys reach the stage CLIs as flag defaults and are validated like the others.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

import pytest

from services.common import config_table, slow_steps
from services.common.deploy_profile import ProfileError, load_profile
from services.common.stage_settings import PROFILE_FLAG_DESTS, parse_stage_args
from tests.deploy_checks import REPO

# bench/: where a benchmark writes its results on the GPU host (its runner sets OUT).
BENCH_ENVIRONMENT = {"OUT"}


def test_config_md_is_generated_from_the_profile() -> None:
    assert config_table.DOC.read_text(encoding="utf-8") == config_table.render(), (
        "docs/config.md is stale: python -m services.common.config_table --write"
    )


def test_every_profile_key_is_in_the_table() -> None:
    text = config_table.render()
    for key in ("gateway.max_realtime_sessions", "stages.thinker.kernels", "stages.talker.steps_per_replay"):
        assert f"`{key}`" in text
    for stage, dests in PROFILE_FLAG_DESTS.items():
        for key in dests:
            assert f"`stages.{stage}.{key}`" in text, (stage, key)


def _env_reads(path: Path) -> set[str]:
    """Literal names of environment variables ``path`` reads (get / getenv / [] / ``in``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    consts = {
        t.id: node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
        for t in node.targets
        if isinstance(t, ast.Name)
    }

    def name(arg: ast.expr) -> str | None:
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            return arg.value
        if isinstance(arg, ast.Name):
            return consts.get(arg.id, f"<{arg.id}>")
        return "<dynamic>"

    def is_environ(node: ast.expr) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
            isinstance(node, ast.Name) and node.id == "environ"
        )

    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            func = node.func
            if (func.attr == "get" and is_environ(func.value)) or func.attr == "getenv":
                found.add(name(node.args[0]) or "<dynamic>")
        elif isinstance(node, ast.Subscript) and is_environ(node.value) and isinstance(node.ctx, ast.Load):
            found.add(name(node.slice) or "<dynamic>")
        elif isinstance(node, ast.Compare) and any(is_environ(c) for c in node.comparators):
            found.add(name(node.left) or "<dynamic>")
    return found


def test_the_code_reads_only_the_documented_environment() -> None:
    allowed = set(config_table.ENVIRONMENT) | BENCH_ENVIRONMENT
    assert len(config_table.ENVIRONMENT) <= 6
    stray: dict[str, set[str]] = {}
    for top in ("services", "gateway", "bench"):
        for path in sorted((REPO / top).rglob("*.py")):
            extra = _env_reads(path) - allowed
            if top != "bench":
                extra |= _env_reads(path) & BENCH_ENVIRONMENT
            if extra:
                stray[path.relative_to(REPO).as_posix()] = extra
    assert stray == {}, f"environment reads outside docs/config.md's list: {stray}"


def test_the_env_walk_finds_each_form(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text(
        "import os\nfrom os import environ\nENV = 'A'\n"
        "def f():\n    os.environ.get(ENV)\n    os.getenv('B')\n    x = os.environ['C']\n"
        "    return 'D' in environ\n"
    )
    assert _env_reads(src) == {"A", "B", "C", "D"}


def _parser(stage: str) -> argparse.ArgumentParser:
    """A stage CLI's parser (the real one, imported lazily: each pulls in its stage)."""
    if stage == "thinker":
        from services.thinker.__main__ import build_parser
    elif stage == "talker":
        from services.talker.server import build_parser
    else:
        from services.code2wav.__main__ import build_parser
    return build_parser()


@pytest.mark.parametrize("stage", ["thinker", "talker", "code2wav"])
def test_profile_keys_become_stage_flag_defaults(stage: str, monkeypatch: pytest.MonkeyPatch) -> None:
    overrides: dict[str, object] = {"slow_step_ms": 7.5}
    if stage != "code2wav":
        overrides["kernels"] = "torch"
    if stage == "talker":
        overrides["steps_per_replay"] = 2
    if stage == "thinker":
        overrides["kernel_table"] = "/tables/h100.json"
        overrides["fp8_table"] = "/tables/h100-fp8.json"
        overrides["max_step_tokens"] = 128
        overrides["whisper_graphs"] = True
    profile = load_profile("cpu").with_overrides({stage: overrides})
    monkeypatch.setenv("MINICPMO_STAGE_SETTINGS", profile.stage(stage).settings_json())
    monkeypatch.setattr(slow_steps, "_threshold_ms", slow_steps.DEFAULT_MS)
    args, _ = parse_stage_args(_parser(stage), stage, ["--checkpoint", "/ckpt"])
    assert args.slow_step_ms == 7.5 and slow_steps.threshold_ms() == 7.5
    if stage != "code2wav":
        assert args.kernels == "torch"
    if stage == "talker":
        assert args.steps_per_replay == 2
    if stage == "thinker":
        assert args.kernel_table == "/tables/h100.json" and args.fp8_table == "/tables/h100-fp8.json"
        assert args.max_step_tokens == 128
        assert args.whisper_graphs is True
    args, _ = parse_stage_args(_parser(stage), stage, ["--checkpoint", "/ckpt", "--slow-step-ms", "0"])
    assert args.slow_step_ms == 0 and slow_steps.threshold_ms() == 0  # the flag wins over the profile


def test_new_keys_are_validated() -> None:
    base = load_profile("cpu")
    with pytest.raises(ProfileError, match="kernels"):
        base.with_overrides({"thinker": {"kernels": "cuda"}})
    with pytest.raises(ProfileError, match="streaming-Whisper graphs are a thinker setting"):
        base.with_overrides({"talker": {"whisper_graphs": True}})
    with pytest.raises(ProfileError, match="whisper_graphs"):
        base.with_overrides({"thinker": {"whisper_graphs": "yes"}})  # a boolean, not a string
    with pytest.raises(ProfileError, match="steps_per_replay"):
        base.with_overrides({"talker": {"steps_per_replay": 0}})
    with pytest.raises(ProfileError, match="slow_step_ms"):
        base.with_overrides({"code2wav": {"slow_step_ms": -1}})
    with pytest.raises(ProfileError, match="kernels"):
        base.with_overrides({"code2wav": {"kernels": "torch"}})  # code2wav has no such kernels
    with pytest.raises(ProfileError, match=r"max_step_tokens \(8\) is below max_num_seqs \(24\)"):
        base.with_overrides({"thinker": {"max_num_seqs": 24, "max_step_tokens": 8}})
    with pytest.raises(ProfileError, match="max_step_tokens"):
        base.with_overrides({"talker": {"max_step_tokens": 128}})  # a thinker setting
    with pytest.raises(ProfileError, match="steps_per_replay"):
        base.with_overrides({"thinker": {"steps_per_replay": 2}})
