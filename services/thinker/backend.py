"""What every thinker stream shares: the engine, the full model (encoders), the processor, the tokenizer.

:func:`build_backend` loads a checkpoint into one :class:`ThinkerBackend`; the CLI
(:mod:`services.thinker.__main__`), the tests and the benchmarks build the stage through it, and the
stream handlers (:mod:`services.thinker.turn_stream`, :mod:`services.thinker.duplex_stream`) only read it.
:func:`stage_info` is what ``GetInfo`` answers about it.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from services.common.checkpoint import Checkpoint
from services.common.pb import common_pb2
from services.common.tensors import compute_dtype, dtype_to_proto
from services.thinker import whisper_graph
from services.thinker.duplex_window import DuplexWindow
from services.thinker.engine import STAGE, EngineConfig, ThinkerEngine
from services.thinker.kv_cache import SEQUENCE_HEADROOM_BYTES
from services.thinker.sampling import DEFAULT_STOP_IDS
from services.thinker.voice import VoicePrefixCache

if TYPE_CHECKING:
    from services.thinker.model import ThinkerModel
    from services.thinker.processor import ThinkerProcessor

PROTOCOL_VERSION = "minicpmo.v1"


@dataclass
class ThinkerBackend:
    """Everything a stream needs: the engine, the full model (encoders), the processor, the tokenizer."""

    engine: ThinkerEngine
    model: ThinkerModel
    processor: ThinkerProcessor
    ckpt: Checkpoint
    device: str
    executor: ThreadPoolExecutor  # encoders and prompt building: off the event loop, beside the engine
    duplex_window: DuplexWindow | None = None  # None: a duplex session ends at the context limit
    # The services.thinker.duplex_encode.DuplexUnitEncoder that batches every duplex session's units into
    # one streaming-Whisper pass, made by the first duplex stream (Any: that module imports this one).
    duplex_encoder: Any = None
    # The grammar engine's token table (services.thinker.constrained.GrammarCompiler), built at load:
    # building it takes about a second of CPU that would otherwise stall the first constrained request.
    grammar: Any = None
    # Registered voices' speech system prefixes, derived once per voice (services.thinker.voice).
    voice_prefixes: VoicePrefixCache = field(default_factory=VoicePrefixCache)

    @property
    def tokenizer(self) -> Any:  # a Hugging Face tokenizer (services.common.checkpoint.Checkpoint.tokenizer)
        return self.processor.tokenizer

    @property
    def hidden_size(self) -> int:
        return self.engine.hidden_size


def build_backend(
    checkpoint: str, device: str, dtype: str | None, engine_config: EngineConfig, whisper_graphs: bool = False
) -> ThinkerBackend:
    """Load the model and processor, size the KV cache and create the (not yet started) engine.

    ``whisper_graphs``: the thinker will capture the duplex encoder's graphs (:mod:`whisper_graph`), so the
    KV budget's reserve counts their memory."""
    from services.thinker.model import ThinkerModel
    from services.thinker.processor import ThinkerProcessor

    ckpt = Checkpoint(checkpoint)
    model = ThinkerModel.from_checkpoint(ckpt, dtype=compute_dtype(dtype, device), device=device)
    processor = ThinkerProcessor.from_checkpoint(ckpt)
    if engine_config.kv_budget_bytes is None and not engine_config.reserve_bytes:
        # Every running sequence may be a duplex session with its own Whisper cache and per-session state
        # (plus two waiting).
        per_sequence = model.audio_stream_bytes() + SEQUENCE_HEADROOM_BYTES
        engine_config.reserve_bytes = (engine_config.max_num_seqs + 2) * per_sequence
        if whisper_graphs and engine_config.use_cuda_graphs:  # the encoder's graphs
            engine_config.reserve_bytes += whisper_graph.reserve_bytes(
                model, whisper_graph.encode_batch_limit(engine_config.max_num_seqs), torch.device(device)
            )
    model.reserve_audio_streams(engine_config.max_num_seqs + 2)  # the sessions the reserve above counts
    engine = ThinkerEngine(model.llm, engine_config, device)
    from services.thinker.constrained import GrammarCompiler

    grammar = GrammarCompiler(processor.tokenizer, len(processor.tokenizer))
    return ThinkerBackend(
        engine, model, processor, ckpt, device, ThreadPoolExecutor(2, "thinker-encode"), grammar=grammar
    )


def stage_info(backend: ThinkerBackend) -> common_pb2.StageInfo:
    engine = backend.engine
    cfg = backend.ckpt.config
    info = common_pb2.StageInfo(
        stage=STAGE,
        model=str(cfg.get("_name_or_path", "openbmb/MiniCPM-o-4_5")),
        model_version=str(cfg.get("version", "")),
        protocol_version=PROTOCOL_VERSION,
        device=backend.device,
        compute_dtype=dtype_to_proto(engine.runner.dtype),
        capabilities=["turn", "duplex", "image", "audio", "video", "speech_hidden", "interrupt"],
    )
    info.limits["max_context"] = engine.max_context
    info.limits["max_streams"] = engine.config.max_num_seqs
    info.limits["kv_budget_bytes"] = engine.cache.budget_bytes
    info.limits["kv_capacity_tokens"] = engine.cache.capacity_tokens
    info.properties["hidden_size"] = str(engine.hidden_size)
    info.properties["vocab_size"] = str(cfg.get("vocab_size", ""))
    info.properties["kv_block_size"] = str(engine.layout.block_size)
    info.properties["stop_token_ids"] = ",".join(str(i) for i in DEFAULT_STOP_IDS)
    info.capabilities.append("constrained_decoding")
    info.properties["cuda_graphs"] = str(engine.runner.use_cuda_graphs).lower()
    return info
