"""Thinker processor: chat messages with images, audio and video -> token ids + encoder inputs.

Usage::

    proc = ThinkerProcessor.from_checkpoint(Checkpoint(dir), limits=ProcessorLimits(max_images=4))
    p = proc([{"role": "user", "content": [ImageInput(png_bytes), "What is shown?"]}])
    embeds = model.embed_prompt(p)                       # services.thinker.model.ThinkerModel

``ProcessedPrompt`` carries ``input_ids`` (placeholders expanded), the slices in patch layout with their
``tgt_sizes`` and ``image_bounds`` (one ``[start, end)`` span of 64 ``<unk>`` per slice), the mel pieces with
their lengths and ``audio_bounds``, and the prompt text. Token ids equal the upstream processor's for the
same messages (checked against the oracle). Bad input raises :class:`~services.thinker.errors.ProcessorError`
(a ``StageError``) naming the offending field.

Duplex helpers: :mod:`services.thinker.processor.duplex_layout` (session prefix and per-unit token layouts),
:meth:`ThinkerProcessor.process_frames` (per-frame ``max_slice_nums``, e.g. ``[2, 1]`` for a stacked pair),
:meth:`ThinkerProcessor.process_audio` (a reference voice) and :class:`StreamingLogMel` (1 s mel units with
the look-ahead frames ``ThinkerModel.get_audio_embeds_streaming`` needs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from services.common.checkpoint import SPECIAL_TOKEN_IDS, Checkpoint
from services.thinker.errors import ProcessorError
from services.thinker.prefix_hash import MediaSpan, media_digest
from services.thinker.processor.audio import (
    SAMPLE_RATE,
    AudioClip,
    MelUnit,
    StreamingLogMel,
    audio_embed_count,
    audio_placeholder,
    decode_audio,
    log_mel,
    split_pieces,
)
from services.thinker.processor.chat import (
    AUDIO_TAG,
    IMAGE_TAG,
    VIDEO_TAG,
    AudioInput,
    ImageInput,
    Message,
    VideoInput,
    normalize_messages,
    render_chat,
    speech_system_message,
)
from services.thinker.processor.image import SliceConfig, decode_image, image_placeholder, slice_image
from services.thinker.processor.video import frame_placeholder, sample_video_frames

UNK_ID = SPECIAL_TOKEN_IDS["<unk>"]
LISTEN_ID = SPECIAL_TOKEN_IDS["<|listen|>"]
_IMAGE_OPEN = (SPECIAL_TOKEN_IDS["<image>"], SPECIAL_TOKEN_IDS["<slice>"])
_IMAGE_CLOSE = (SPECIAL_TOKEN_IDS["</image>"], SPECIAL_TOKEN_IDS["</slice>"])
_AUDIO_OPEN = SPECIAL_TOKEN_IDS["<|audio_start|>"]
_AUDIO_CLOSE = SPECIAL_TOKEN_IDS["<|audio_end|>"]

__all__ = [
    "AudioClip",
    "AudioInput",
    "ImageInput",
    "Message",
    "MelUnit",
    "ProcessedPrompt",
    "ProcessorError",
    "ProcessorLimits",
    "StreamingLogMel",
    "ThinkerProcessor",
    "VideoInput",
    "speech_system_message",
]


@dataclass(frozen=True)
class ProcessorLimits:
    """Per-prompt caps; exceeding one raises ``ProcessorError`` (invalid_argument) naming the limit."""

    max_images: int = 16
    max_audios: int = 8
    max_video_frames: int = 64
    max_audio_seconds: float = 600.0
    max_slice_nums: int | None = None  # None: the checkpoint's slice_config value
    max_prompt_tokens: int | None = None  # None: no check here (the engine checks the context)


@dataclass
class ProcessedPrompt:
    """Everything the model needs for one prompt (batch of one; tensors on CPU)."""

    prompt_text: str
    input_ids: torch.Tensor  # [L] int64
    pixel_values: list[torch.Tensor] = field(default_factory=list)  # each [3, 14, 14 * h * w] float32
    tgt_sizes: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 2, dtype=torch.long))
    image_bounds: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 2, dtype=torch.long))
    audio_features: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 80, 0))  # [N, 80, T]
    audio_feature_lens: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    audio_bounds: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 2, dtype=torch.long))
    num_images: int = 0
    num_audios: int = 0
    num_video_frames: int = 0
    # Every image/audio row span keyed by its media's content digest (the prefix cache's key, so a
    # repeated picture or clip hits like repeated text does).
    media_spans: list[MediaSpan] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def _spans(ids: torch.Tensor, opens: tuple[int, ...], closes: tuple[int, ...]) -> torch.Tensor:
    starts = torch.nonzero(torch.isin(ids, torch.tensor(opens)), as_tuple=True)[0] + 1
    ends = torch.nonzero(torch.isin(ids, torch.tensor(closes)), as_tuple=True)[0]
    if starts.numel() != ends.numel():
        raise ProcessorError("messages", "unbalanced multimodal framing tokens in the prompt text")
    return torch.stack([starts, ends], dim=1) if starts.numel() else torch.zeros(0, 2, dtype=torch.long)


class ThinkerProcessor:
    """Turns chat messages into a :class:`ProcessedPrompt` (see the module docstring)."""

    def __init__(
        self,
        tokenizer: Any,
        slice_config: SliceConfig,
        *,
        query_num: int = 64,
        audio_pool_step: int = 5,
        use_image_id: bool = True,
        limits: ProcessorLimits | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.slice_config = slice_config
        self.query_num = query_num
        self.audio_pool_step = audio_pool_step
        self.use_image_id = use_image_id
        self.limits = limits or ProcessorLimits()

    @classmethod
    def from_checkpoint(
        cls, ckpt: Checkpoint | str, limits: ProcessorLimits | None = None
    ) -> ThinkerProcessor:
        if not isinstance(ckpt, Checkpoint):
            ckpt = Checkpoint(ckpt)
        cfg = ckpt.config
        pre = ckpt.preprocessor_config
        sc = ckpt.slice_config
        slice_cfg = SliceConfig(
            max_slice_nums=int(sc.get("max_slice_nums", pre.get("max_slice_nums", 9))),
            scale_resolution=int(sc.get("scale_resolution", pre.get("scale_resolution", 448))),
            patch_size=int(sc.get("patch_size", pre.get("patch_size", 14))),
            mean=tuple(float(x) for x in pre.get("norm_mean", (0.5, 0.5, 0.5))),  # type: ignore[arg-type]
            std=tuple(float(x) for x in pre.get("norm_std", (0.5, 0.5, 0.5))),  # type: ignore[arg-type]
        )
        return cls(
            ckpt.tokenizer(),
            slice_cfg,
            query_num=int(cfg["query_num"]),
            audio_pool_step=int(cfg["audio_pool_step"]),
            use_image_id=bool(pre.get("use_image_id", cfg.get("use_image_id", True))),
            limits=limits,
        )

    # ------------------------------------------------------------------------------------- helpers
    def encode_text(self, text: str) -> list[int]:
        """Plain tokenisation (special-token strings in ``text`` become their ids, as upstream)."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _check_counts(self, messages: list[Message]) -> tuple[int, int, int]:
        images = audios = frames = 0
        for msg in messages:
            for part in msg.content:
                if isinstance(part, ImageInput):
                    images += 1
                elif isinstance(part, AudioInput):
                    audios += 1
                elif isinstance(part, VideoInput):
                    frames += len(part.frames) if part.frames else 0
        lim = self.limits
        if images > lim.max_images:
            raise ProcessorError("messages", f"{images} images in the prompt; the limit is {lim.max_images}")
        if audios > lim.max_audios:
            raise ProcessorError(
                "messages", f"{audios} audio clips in the prompt; the limit is {lim.max_audios}"
            )
        if frames > lim.max_video_frames:
            raise ProcessorError(
                "messages", f"{frames} video frames in the prompt; the limit is {lim.max_video_frames}"
            )
        return images, audios, frames

    def _max_slices(self, override: int | None) -> int:
        value = override if override is not None else self.limits.max_slice_nums
        value = self.slice_config.max_slice_nums if value is None else int(value)
        if value < 1:
            raise ProcessorError("max_slice_nums", f"max_slice_nums must be >= 1 (got {value})")
        return value

    # ---------------------------------------------------------------------------------------- call
    def __call__(
        self,
        messages: object,
        *,
        enable_thinking: bool = False,
        use_tts_template: bool | None = None,
        add_generation_prompt: bool = True,
        max_slice_nums: int | None = None,
        use_image_id: bool | None = None,
        join_parts: str = "\n",
        audio_chunked_placeholders: bool = False,
        tools: Sequence[str] = (),
    ) -> ProcessedPrompt:
        """Render, expand placeholders, tokenise and prepare encoder inputs.

        ``use_tts_template=None`` switches it on when any message carries audio (upstream ``chat()``).
        ``audio_chunked_placeholders`` writes one ``<|audio_start|>…<|audio_end|>`` group per second
        instead of one group per clip (upstream's streaming-input layout); the embeddings are the same.
        """
        msgs = normalize_messages(messages)
        n_images, n_audios, _ = self._check_counts(msgs)
        if use_tts_template is None:
            use_tts_template = n_audios > 0
        text = render_chat(
            msgs,
            add_generation_prompt=add_generation_prompt,
            enable_thinking=enable_thinking,
            use_tts_template=use_tts_template,
            join_parts=join_parts,
            tools=tools,
        )
        image_ids = self.use_image_id if use_image_id is None else bool(use_image_id)
        default_slices = self._max_slices(max_slice_nums)

        media = [
            (i, j, p) for i, m in enumerate(msgs) for j, p in enumerate(m.content) if not isinstance(p, str)
        ]
        tag_count = sum(text.count(tag) for tag in (IMAGE_TAG, AUDIO_TAG, VIDEO_TAG))
        if tag_count != len(media):
            raise ProcessorError("messages", "message text must not contain media placeholder tags")

        expanded = _Expansion()
        rest = text
        for mi, pj, part in media:
            param = f"messages[{mi}].content[{pj}]"
            before, _, rest = rest.partition(
                next(tag for kind, tag in _TAGS.items() if isinstance(part, kind))
            )
            expanded.pieces.append(before)
            if isinstance(part, ImageInput):
                self._expand_image(expanded, part, param, default_slices, image_ids)
            elif isinstance(part, AudioInput):
                self._expand_audio(expanded, part, param, audio_chunked_placeholders)
            else:
                self._expand_video(expanded, part, param)
        expanded.pieces.append(rest)
        final_text = "".join(expanded.pieces)

        ids = torch.tensor([t for t in self.encode_text(final_text) if t != LISTEN_ID], dtype=torch.long)
        image_bounds = _spans(ids, _IMAGE_OPEN, _IMAGE_CLOSE)
        audio_bounds = _spans(ids, (_AUDIO_OPEN,), (_AUDIO_CLOSE,))
        self._validate_spans(ids, image_bounds, expanded.image_spans, audio_bounds, expanded.audio_rows)
        if self.limits.max_prompt_tokens is not None and ids.numel() > self.limits.max_prompt_tokens:
            raise ProcessorError(
                "messages", f"prompt has {ids.numel()} tokens; the limit is {self.limits.max_prompt_tokens}"
            )
        feats, lens = _pad_mels(expanded.mels)
        media_spans = _key_spans(expanded.media, image_bounds.tolist(), audio_bounds.tolist())
        return ProcessedPrompt(
            prompt_text=final_text,
            input_ids=ids,
            pixel_values=expanded.pixel_values,
            tgt_sizes=torch.tensor(expanded.tgt_sizes, dtype=torch.long).reshape(-1, 2),
            image_bounds=image_bounds,
            audio_features=feats,
            audio_feature_lens=lens,
            audio_bounds=audio_bounds,
            num_images=n_images,
            num_audios=n_audios,
            num_video_frames=expanded.video_frames,
            media_spans=media_spans,
        )

    def _expand_image(
        self, ex: _Expansion, part: ImageInput, param: str, default_slices: int, image_ids: bool
    ) -> None:
        img = decode_image(part.data, param)
        max_slices = self._max_slices(part.max_slice_nums or default_slices)
        sliced = slice_image(img, self.slice_config, max_slices)
        digest = media_digest("image", img.mode, img.width, img.height, img.tobytes(), max_slices)
        ex.media.append(("image", digest, len(sliced.slices)))
        ex.pixel_values.extend(sliced.slices)
        ex.tgt_sizes.extend(sliced.tgt_sizes)
        ex.image_spans += len(sliced.slices)
        ex.pieces.append(
            image_placeholder(sliced.grid, self.query_num, ex.image_index if image_ids else None)
        )
        ex.image_index += 1

    def _expand_audio(self, ex: _Expansion, part: AudioInput, param: str, chunked: bool) -> None:
        wave = decode_audio(part.data, param)
        ex.audio_seconds += len(wave) / SAMPLE_RATE
        if ex.audio_seconds > self.limits.max_audio_seconds:
            raise ProcessorError(
                param, f"audio in the prompt exceeds {self.limits.max_audio_seconds:g} s in total"
            )
        count = audio_embed_count(len(wave), self.audio_pool_step)
        ex.media.append(("audio", media_digest("audio", wave.dtype.str, wave.tobytes()), count))
        ex.mels.extend(log_mel(piece) for piece in split_pieces(wave))
        ex.audio_rows += count
        ex.pieces.append(audio_placeholder(count, chunked))

    def _expand_video(self, ex: _Expansion, part: VideoInput, param: str) -> None:
        frames = list(part.frames)
        if part.data is not None:
            frames = sample_video_frames(part.data, param, max_frames=self.limits.max_video_frames)
        if not frames:
            raise ProcessorError(param, "video has no frames")
        ex.video_frames += len(frames)
        if ex.video_frames > self.limits.max_video_frames:
            raise ProcessorError(
                param,
                f"{ex.video_frames} video frames in the prompt; the limit is {self.limits.max_video_frames}",
            )
        for k, frame in enumerate(frames):
            img = decode_image(frame, f"{param}.frames[{k}]")
            sliced = slice_image(img, self.slice_config, 1)
            ex.media.append(
                ("image", media_digest("frame", img.mode, img.width, img.height, img.tobytes()), 1)
            )
            ex.pixel_values.extend(sliced.slices)
            ex.tgt_sizes.extend(sliced.tgt_sizes)
            ex.image_spans += 1
        ex.pieces.append(frame_placeholder(self.query_num) * len(frames))

    def _validate_spans(
        self,
        ids: torch.Tensor,
        image_bounds: torch.Tensor,
        n_slices: int,
        audio_bounds: torch.Tensor,
        audio_rows: int,
    ) -> None:
        """Framing tokens typed by the user would shift the spans: refuse instead of mis-merging."""
        ok = image_bounds.shape[0] == n_slices and all(
            e - s == self.query_num and bool((ids[s:e] == UNK_ID).all()) for s, e in image_bounds.tolist()
        )
        if ok:
            got_audio = sum(e - s for s, e in audio_bounds.tolist())
            ok = got_audio == audio_rows and all(
                bool((ids[s:e] == UNK_ID).all()) for s, e in audio_bounds.tolist()
            )
        if not ok:
            raise ProcessorError(
                "messages",
                "message text contains reserved multimodal tokens (<image>, <slice>, <unk>, audio markers)",
            )

    # ------------------------------------------------------------------------------- media helpers
    def process_frames(
        self, frames: list[object], max_slice_nums: int | list[int] = 1, param: str = "frames"
    ) -> tuple[list[torch.Tensor], torch.Tensor, list[int]]:
        """Duplex frames -> (slices, tgt_sizes [n, 2], slices per frame); per-frame ``max_slice_nums``.

        A stacked pair uses ``[2, 1]`` (docs/model.md, Duplex): the current frame in HD, the composite not.
        """
        per_frame = (
            [max_slice_nums] * len(frames) if isinstance(max_slice_nums, int) else list(max_slice_nums)
        )
        if len(per_frame) != len(frames):
            raise ProcessorError("max_slice_nums", "max_slice_nums list must have one entry per frame")
        slices: list[torch.Tensor] = []
        sizes: list[tuple[int, int]] = []
        counts: list[int] = []
        for k, (frame, n) in enumerate(zip(frames, per_frame, strict=True)):
            sliced = slice_image(decode_image(frame, f"{param}[{k}]"), self.slice_config, self._max_slices(n))
            slices.extend(sliced.slices)
            sizes.extend(sliced.tgt_sizes)
            counts.append(len(sliced.slices))
        return slices, torch.tensor(sizes, dtype=torch.long).reshape(-1, 2), counts

    def process_audio(self, data: object, param: str = "audio") -> tuple[torch.Tensor, torch.Tensor, int]:
        """One clip -> (mel pieces [N, 80, T], lengths [N], embedding count), e.g. a reference voice."""
        wave = decode_audio(data, param)
        mels = [log_mel(p) for p in split_pieces(wave)]
        lens = torch.tensor([m.shape[1] for m in mels], dtype=torch.long)
        feats = torch.zeros(len(mels), mels[0].shape[0], int(lens.max()))
        for i, m in enumerate(mels):
            feats[i, :, : m.shape[1]] = m
        return feats, lens, audio_embed_count(len(wave), self.audio_pool_step)


_TAGS: dict[type, str] = {ImageInput: IMAGE_TAG, AudioInput: AUDIO_TAG, VideoInput: VIDEO_TAG}


@dataclass
class _Expansion:
    """What expanding a prompt's media placeholders collects, in prompt order."""

    pieces: list[str] = field(default_factory=list)  # the prompt text with placeholders expanded
    pixel_values: list[torch.Tensor] = field(default_factory=list)
    tgt_sizes: list[tuple[int, int]] = field(default_factory=list)
    image_spans: int = 0
    image_index: int = 0
    mels: list[torch.Tensor] = field(default_factory=list)
    audio_rows: int = 0
    audio_seconds: float = 0.0
    video_frames: int = 0
    # (kind, content digest, extent) per media item in prompt order: an image's extent is its slice
    # count (one image span each), an audio clip's its embedding rows (over one or more audio spans)
    media: list[tuple[str, bytes, int]] = field(default_factory=list)


def _key_spans(
    media: list[tuple[str, bytes, int]], image_bounds: list[list[int]], audio_bounds: list[list[int]]
) -> list[MediaSpan]:
    """The prompt's image/audio spans, each keyed by the digest of the item it came from.

    Spans are in prompt order within each kind (validated against the expansion before this runs), so
    items take them in order; a row's key offset counts rows from the item's first row.
    """
    images, audios = iter(image_bounds), iter(audio_bounds)
    out: list[MediaSpan] = []
    for kind, digest, extent in media:
        rows = 0
        if kind == "image":
            for _ in range(extent):
                start, end = next(images)
                out.append(MediaSpan(start, end, digest, rows))
                rows += end - start
        else:
            while rows < extent:
                start, end = next(audios)
                out.append(MediaSpan(start, end, digest, rows))
                rows += end - start
    return sorted(out, key=lambda span: span.start)


def _pad_mels(mels: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Mel pieces -> ``[pieces, 80, longest]`` zero-padded features and their lengths."""
    if not mels:
        return torch.zeros(0, 80, 0), torch.zeros(0, dtype=torch.long)
    lens = torch.tensor([m.shape[1] for m in mels], dtype=torch.long)
    feats = torch.zeros(len(mels), mels[0].shape[0], int(lens.max()))
    for i, m in enumerate(mels):
        feats[i, :, : m.shape[1]] = m
    return feats, lens
