"""Shared pytest fixtures.

``tiny_ckpt``: a tiny random-weight checkpoint in the real MiniCPM-o 4.5 layout, produced once per test
session by the project's own generator (``minicpmo-checkpoint make --size tiny --seed 0``, ~10 s, ~255 MiB).
Set ``MINICPMO_TINY_CKPT=/some/dir`` to reuse a checkpoint across sessions: the directory is used as is when
it already holds a ``config.json``, otherwise it is generated there first. Treat the fixture as read-only:
tests that need a modified checkpoint copy it (see tests/test_checkpoint_contract.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

TINY_SEED = 0


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from services.common.checkpoint_tool.generate import make_checkpoint

    reuse = os.environ.get("MINICPMO_TINY_CKPT")
    if reuse:
        path = Path(reuse).expanduser().resolve()
        if not (path / "config.json").is_file():
            make_checkpoint(path, size="tiny", seed=TINY_SEED, force=True, log=lambda _msg: None)
        return path
    path = tmp_path_factory.mktemp("tiny_ckpt")
    return make_checkpoint(path, size="tiny", seed=TINY_SEED, log=lambda _msg: None)
