"""Shared pytest fixtures.

``tiny_ckpt``: a tiny random-weight checkpoint in the real MiniCPM-o 4.5 layout, produced once per test
session by the project's own generator (``minicpmo-checkpoint make --size tiny --seed 0``, ~10 s, ~255 MiB).
Set ``MINICPMO_TINY_CKPT=/some/dir`` to reuse a checkpoint across sessions: the directory is used as is when
it holds a complete checkpoint from the current generator version (its manifest says so), otherwise it is
(re)generated there first. Treat the fixture as read-only:
tests that need a modified checkpoint copy it (see tests/test_checkpoint_contract.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Without a GPU, Triton runs only through its interpreter, and that must be chosen before triton is first
# imported anywhere in the run (triton's own library functions are decorated at import): a test module
# that imports torch's or our Triton code earlier would otherwise leave them compiled-only.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

TINY_SEED = 0


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from services.common.checkpoint_tool.generate import GENERATOR_VERSION, make_checkpoint, read_manifest

    reuse = os.environ.get("MINICPMO_TINY_CKPT")
    if reuse:
        path = Path(reuse).expanduser().resolve()
        manifest = read_manifest(path) or {}
        wanted = {"generator_version": GENERATOR_VERSION, "size": "tiny", "seed": TINY_SEED, "device": "cpu"}
        if any(manifest.get(k) != v for k, v in wanted.items()):
            make_checkpoint(path, size="tiny", seed=TINY_SEED, force=True, log=lambda _msg: None)
        return path
    path = tmp_path_factory.mktemp("tiny_ckpt")
    return make_checkpoint(path, size="tiny", seed=TINY_SEED, log=lambda _msg: None)


@pytest.fixture
def triton_interpreter_scalars(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run Triton kernels through the interpreter on CPU (skip otherwise), with loop bounds it accepts.

    Triton 3.6's interpreter turns loop bounds into ints with ``int(ndarray)``, which numpy >= 2.4
    refuses for 1-element arrays; take the element instead (test-only, interpreter-only).
    """
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the kernels run on CPU only through the Triton interpreter")
    import numpy as np
    from triton.runtime import interpreter

    orig = interpreter._patch_lang_tensor

    def patched(tensor, scope):  # noqa: ANN001, ANN202
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", patched)
