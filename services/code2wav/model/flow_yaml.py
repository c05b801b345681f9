"""Build the flow model from ``flow.yaml`` without executing arbitrary YAML.

The checkpoint's ``flow.yaml`` is written for hyperpyyaml, whose loader can instantiate any importable
object. We only ever need the four constructor tags that Step-Audio2 uses (docs/model.md, Code2Wav), so a
``yaml.SafeLoader`` subclass maps exactly those tags to the installed stepaudio2 classes; any other tag is
a hard error, which keeps a tampered checkpoint from running code at load time.

Two of the classes allocate fixed scratch buffers in ``__init__`` that are sized for the full model
(the CFM wrapper's ``att_cache_buffer`` alone is 2.1 GiB). We never use those buffers (the streaming
step in :mod:`flow_step` keeps its own caches sized from the model), so the DiT and the CFM wrapper are
constructed on the ``meta`` device, their scratch buffers are swapped for empty tensors, and only then
is real (uninitialised) storage allocated; ``flow.pt`` fills every parameter afterwards.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import yaml
from stepaudio2.cosyvoice2.flow.decoder_dit import DiT
from stepaudio2.cosyvoice2.flow.flow import CausalMaskedDiffWithXvec
from stepaudio2.cosyvoice2.flow.flow_matching import CausalConditionalCFM
from stepaudio2.cosyvoice2.transformer.upsample_encoder_v2 import UpsampleConformerEncoderV2


class FlowConfigError(ValueError):
    """``flow.yaml`` is malformed or uses a tag outside the four allowed ones."""


# Scratch buffers that the package allocates at a fixed (full-model) size and that we never read.
_SCRATCH_BUFFERS: dict[type, tuple[str, ...]] = {
    DiT: ("att_cache_buffer", "cnn_cache_buffer"),
    CausalConditionalCFM: ("rand_noise", "att_cache_buffer", "cnn_cache_buffer"),
}


def _build_without_scratch(cls: type, kwargs: dict[str, Any]) -> torch.nn.Module:
    """Construct ``cls`` on the meta device, drop its scratch buffers, then give it real storage."""
    with torch.device("meta"):
        module = cls(**kwargs)
    for sub in module.modules():
        for name in _SCRATCH_BUFFERS.get(type(sub), ()):
            sub.register_buffer(name, torch.empty(0, device="meta"), persistent=False)
    return module.to_empty(device="cpu")


def _build_plain(cls: type, kwargs: dict[str, Any]) -> torch.nn.Module:
    return cls(**kwargs)


# Tag -> (class, builder). Module paths are the ones the real flow.yaml names (cosyvoice2.* aliases).
_TAGS: dict[str, tuple[type, Any]] = {
    "!new:cosyvoice2.flow.flow.CausalMaskedDiffWithXvec": (CausalMaskedDiffWithXvec, _build_plain),
    "!new:cosyvoice2.transformer.upsample_encoder_v2.UpsampleConformerEncoderV2": (
        UpsampleConformerEncoderV2,
        _build_plain,
    ),
    "!new:cosyvoice2.flow.flow_matching.CausalConditionalCFM": (CausalConditionalCFM, _build_without_scratch),
    "!new:cosyvoice2.flow.decoder_dit.DiT": (DiT, _build_without_scratch),
}


class _FlowYamlLoader(yaml.SafeLoader):
    """SafeLoader that knows the four Step-Audio2 constructor tags and nothing else."""


def _make_constructor(cls: type, builder: Any) -> Any:
    def construct(loader: yaml.SafeLoader, node: yaml.Node) -> torch.nn.Module:
        if not isinstance(node, yaml.MappingNode):
            raise FlowConfigError(f"{cls.__name__}: expected a mapping of constructor arguments")
        kwargs = loader.construct_mapping(node, deep=True)
        try:
            return builder(cls, kwargs)
        except TypeError as exc:
            raise FlowConfigError(
                f"{cls.__name__}: bad constructor arguments {sorted(kwargs)}: {exc}"
            ) from exc

    return construct


for _tag, (_cls, _builder) in _TAGS.items():
    _FlowYamlLoader.add_constructor(_tag, _make_constructor(_cls, _builder))


def load_flow_from_yaml(path: str | Path) -> CausalMaskedDiffWithXvec:
    """Parse ``flow.yaml`` and return the (weightless) flow module; weights come from ``flow.pt``."""
    text = Path(path).read_text(encoding="utf-8")
    try:
        doc = yaml.load(text, Loader=_FlowYamlLoader)  # noqa: S506 - SafeLoader subclass with 4 fixed tags
    except yaml.constructor.ConstructorError as exc:
        raise FlowConfigError(
            f"{path}: {exc.problem} (only the four Step-Audio2 flow tags are allowed)"
        ) from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("flow"), CausalMaskedDiffWithXvec):
        raise FlowConfigError(f"{path}: expected a top-level 'flow' key built with CausalMaskedDiffWithXvec")
    return doc["flow"]
