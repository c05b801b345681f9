"""Chat messages and the Qwen-style chat template of MiniCPM-o 4.5 (docs/model.md, Thinker prompts).

Rendering rules (the checkpoint's template):

* each message is ``<|im_start|>{role}\\n{content}<|im_end|>\\n``; a message's parts are joined with a
  newline (``join_parts="\\n"``, as upstream ``chat()``; omni/streaming input joins with ``""``), and media
  parts stand as ``<image>./</image>``, ``<audio>./</audio>`` or ``<video>./</video>`` until expanded;
* an assistant message keeps only the text after its last ``</think>``; the final message, when it is an
  assistant message after the last user message, is re-rendered with its ``<think>`` block;
* with ``tools``, the first block is a system message holding the first system message's text, then
  the tools header (one JSON signature per line inside ``<tools></tools>``) and the call format; an
  assistant message's ``tool_calls`` follow its text as ``<tool_call>`` blocks, and consecutive ``tool``
  messages share one user message of ``<tool_response>`` blocks (docs/model.md, "Tool calls");
* the generation prompt is ``<|im_start|>assistant\\n``, then ``<think>\\n\\n</think>\\n\\n`` when
  thinking is off, then ``<|tts_bos|>`` when the TTS template is on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from PIL import Image

from services.thinker.errors import ProcessorError
from services.thinker.processor.audio import AudioClip

IMAGE_TAG = "<image>./</image>"
AUDIO_TAG = "<audio>./</audio>"
VIDEO_TAG = "<video>./</video>"
ROLES = ("system", "user", "assistant", "tool")
TOOLS_HEADER = (
    "# Tools\n\nThe functions you may call are described inside <tools></tools>, one JSON signature per line:\n"
    "<tools>"
)
TOOLS_FOOTER = (
    "\n</tools>\n\nTo call functions, reply with one JSON object per call, each inside <tool_call></tool_call> "
    'tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
)
EMPTY_THINK = "<think>\n\n</think>\n\n"
TTS_BOS = "<|tts_bos|>"


def tools_block(tools: Sequence[str]) -> str:
    """The tools part of the template's system message: the header, one JSON signature per line, the call
    format, then ``<|im_end|>\\n`` (the chat prompt and a duplex tools note both use it)."""
    return TOOLS_HEADER + "".join("\n" + t for t in tools) + TOOLS_FOOTER


def tool_response_block(output: str) -> str:
    """One function result inside the template's user message of tool responses."""
    return "\n<tool_response>\n" + output + "\n</tool_response>"


@dataclass(frozen=True)
class ImageInput:
    """An image: encoded bytes, a PIL image or an ``[H, W, 3]`` uint8 array."""

    data: object
    max_slice_nums: int | None = None


@dataclass(frozen=True)
class AudioInput:
    """Audio: encoded bytes, an :class:`AudioClip` (any rate) or a 16 kHz float32 array."""

    data: object


@dataclass(frozen=True)
class VideoInput:
    """A video: frames already sampled at 1 fps (bytes / PIL / arrays) or a container in ``data``."""

    frames: tuple[object, ...] = ()
    data: bytes | None = None


Part = str | ImageInput | AudioInput | VideoInput


@dataclass(frozen=True)
class ToolCall:
    """A call an assistant turn made: rendered back as a ``<tool_call>`` block."""

    name: str
    arguments: str  # JSON text, as the client sent it
    id: str = ""


@dataclass
class Message:
    role: str
    content: list[Part] = field(default_factory=list)
    tool_calls: list[ToolCall] = field(default_factory=list)


def tool_call_block(call: ToolCall) -> str:
    """The model's format of one call (the chat template's, byte for byte)."""
    return '<tool_call>\n{"name": "' + call.name + '", "arguments": ' + call.arguments + "}\n</tool_call>"


def as_part(obj: object) -> Part:
    """Accept the loose forms upstream ``chat()`` takes: PIL image = image, 1-D array = 16 kHz audio."""
    if isinstance(obj, (str, ImageInput, AudioInput, VideoInput)):
        return obj
    if isinstance(obj, Image.Image):
        return ImageInput(obj)
    if isinstance(obj, AudioClip):
        return AudioInput(obj)
    if isinstance(obj, np.ndarray):
        return AudioInput(obj) if obj.ndim == 1 else ImageInput(obj)
    raise ProcessorError("messages", f"unsupported content part of type {type(obj).__name__}")


def normalize_messages(messages: object) -> list[Message]:
    """Messages as :class:`Message` or ``{"role", "content"}`` dicts (content: str or list of parts)."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ProcessorError("messages", "messages must be a non-empty list")
    out: list[Message] = []
    for i, msg in enumerate(messages):
        role: object  # a dict's role is checked against ROLES below
        calls: list[ToolCall] = []
        if isinstance(msg, Message):
            role, content, calls = msg.role, msg.content, list(msg.tool_calls)
        elif isinstance(msg, dict):
            role, content = msg.get("role"), msg.get("content", [])
            if content is None:
                content = []
        else:
            raise ProcessorError(f"messages[{i}]", "each message must have a role and content")
        if role not in ROLES:
            raise ProcessorError(f"messages[{i}].role", f"role must be one of {list(ROLES)} (got {role!r})")
        if i == 0 and role not in ("user", "system"):
            raise ProcessorError("messages[0].role", "the first message must be a system or user message")
        parts = [content] if isinstance(content, str) else list(content)
        out.append(Message(str(role), [as_part(p) for p in parts], calls))
    return out


def part_text(part: Part) -> str:
    if isinstance(part, str):
        return part
    if isinstance(part, ImageInput):
        return IMAGE_TAG
    if isinstance(part, AudioInput):
        return AUDIO_TAG
    return VIDEO_TAG


def render_chat(
    messages: list[Message],
    *,
    add_generation_prompt: bool = True,
    enable_thinking: bool = False,
    use_tts_template: bool = False,
    join_parts: str = "\n",
    tools: Sequence[str] = (),
) -> str:
    """The prompt text, with media still as tags (see the module docstring for the rules).

    ``tools``: one JSON signature per tool (``{"type": "function", "function": {...}}`` as text).
    """
    texts = [join_parts.join(part_text(p) for p in m.content) for m in messages]
    last_user = max(
        (
            i
            for i, m in enumerate(messages)
            if m.role == "user"
            and not (texts[i].startswith("<tool_response>") and texts[i].endswith("</tool_response>"))
        ),
        default=len(messages) - 1,
    )
    pieces: list[str] = []
    skip_first = False
    if tools:
        head = "<|im_start|>system\n"
        if messages and messages[0].role == "system":
            head += texts[0] + "\n\n"
            skip_first = True
        pieces.append(head + tools_block(tools))
    for i, (msg, text) in enumerate(zip(messages, texts, strict=True)):
        if i == 0 and skip_first:
            continue
        if msg.role in ("system", "user"):
            pieces.append(f"<|im_start|>{msg.role}\n{text}<|im_end|>\n")
            continue
        if msg.role == "tool":
            if i == 0 or messages[i - 1].role != "tool":
                pieces.append("<|im_start|>user")
            pieces.append(tool_response_block(text))
            if i == len(messages) - 1 or messages[i + 1].role != "tool":
                pieces.append("<|im_end|>\n")
            continue
        content, reasoning = text, ""
        if "</think>" in text:
            content = text.split("</think>")[-1].lstrip("\n")
            reasoning = text.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
        is_last = i == len(messages) - 1
        if i > last_user and (is_last or reasoning):
            body = "<think>\n" + reasoning.strip("\n") + "\n</think>\n\n" + content.lstrip("\n")
        else:
            body = content
        calls = "".join(
            ("\n" if j or body else "") + tool_call_block(call) for j, call in enumerate(msg.tool_calls)
        )
        pieces.append(f"<|im_start|>assistant\n{body}{calls}<|im_end|>\n")
    if add_generation_prompt:
        pieces.append("<|im_start|>assistant\n")
        if not enable_thinking:
            pieces.append(EMPTY_THINK)
        if use_tts_template:
            pieces.append(TTS_BOS)
    return "".join(pieces)


# System prompts for speech output (docs/model.md, Thinker prompts). Exact strings: the model was trained on
# them.
_SPEECH_PROMPTS: dict[tuple[str, str], tuple[str, str]] = {
    ("audio_assistant", "en"): (
        "Use the voice in the audio prompt to synthesize new content.",
        "You are a helpful assistant with the above voice style.",
    ),
    ("audio_assistant", "zh"): (
        "模仿音频样本的音色并生成新的内容。",
        "你的任务是用这种声音模式来当一个助手。请认真、高质量地回复用户的问题。请用高自然度的方式和用户聊天。"
        "你是由面壁智能开发的人工智能助手：面壁小钢炮。",
    ),
    ("omni", "en"): (
        "Clone the voice in the provided audio prompt.",
        "As an assistant, you will speak using this voice style.",
    ),
    ("omni", "zh"): (
        "模仿音频样本的音色并生成新的内容。",
        "请用这种声音风格来为用户提供帮助。 请认真、高质量地回复用户的问题。 请用高自然度的方式和用户聊天。",
    ),
    ("audio_roleplay", "en"): (
        "Clone the voice in the provided audio prompt.",
        "Try to role-play the character based on the audio prompt above.",
    ),
    ("audio_roleplay", "zh"): ("模仿输入音频中的声音特征。", "假装你是上述音频中的人物，与我进行对话。"),
    ("voice_cloning", "en"): ("Clone the voice in the provided audio prompt.", ""),
    ("voice_cloning", "zh"): ("模仿输入音频中的声音特征。", ""),
}
DEFAULT_SYSTEM_PROMPT = (
    "You are a helpful assistant. You can accept audio and text input and output voice and text."
)
SPEECH_MODES = ("default", "audio_assistant", "omni", "audio_roleplay", "voice_cloning")


def speech_system_message(
    ref_audio: object | None = None, mode: str = "audio_assistant", language: str = "en"
) -> Message:
    """The system message upstream builds for speech output: ``[prefix, reference audio, suffix]``.

    Without a reference voice, ``audio_assistant``/``audio_roleplay`` fall back to the default-voice text,
    ``omni`` to an empty system prompt, and ``voice_cloning`` is an error.
    """
    if mode not in SPEECH_MODES:
        raise ProcessorError(
            "system_prompt_mode", f"unknown mode {mode!r}; expected one of {list(SPEECH_MODES)}"
        )
    if language not in ("en", "zh"):
        raise ProcessorError("language", f"language must be 'en' or 'zh' (got {language!r})")
    if mode == "default":
        return Message("system", [DEFAULT_SYSTEM_PROMPT])
    prefix, suffix = _SPEECH_PROMPTS[(mode, language)]
    if ref_audio is None:
        if mode == "voice_cloning":
            raise ProcessorError("ref_audio", "voice_cloning mode needs a reference audio")
        if mode == "omni":
            return Message("system", [""])
        return Message("system", ["Use the <reserved_53> voice.", suffix])
    audio = ref_audio if isinstance(ref_audio, AudioInput) else AudioInput(ref_audio)
    parts: list[Part] = [prefix, audio]
    if suffix:
        parts.append(suffix)
    return Message("system", parts)
