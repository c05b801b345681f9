"""A synthesized byte-level BPE tokenizer with the MiniCPM-o 4.5 id layout (docs/model.md, Token ids).

The real vocabulary cannot be shipped, but code under test depends on its *ids*, not its merges: control
tokens must sit at 151643..151747, ``<unk>`` must re-use base id 128244, and prompts such as
``<|im_start|>user\\nhi<|im_end|>`` must split the control tokens out. So we build our own base vocabulary of
exactly 151,643 byte-level tokens and then register the 105 added tokens in id order.

Base vocabulary, in id order (id 128244 is reserved for the literal ``<unk>``):

1. the 256 byte symbols (GPT-2 style byte-to-unicode mapping, so every byte sequence is encodable);
2. merges learned by plain BPE from a small built-in English corpus, so ordinary words get short encodings;
3. every pair of ASCII bytes and every two-byte UTF-8 character, so punctuation runs such as ``./`` are one
   token;
4. systematic extensions of text-like tokens by one ASCII letter/digit until the vocabulary is full.

Each merge's parts exist before it, so the merge list is a valid BPE and every token is reachable.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from .chat_template import CHAT_TEMPLATE

BASE_VOCAB_SIZE = 151643
UNK_ID = 128244
UNK_TOKEN = "<unk>"

# Pre-tokenization split used by Qwen2-family tokenizers (contractions, letter runs, single digits,
# punctuation runs, newlines, whitespace).
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _added_token_names() -> list[tuple[str, bool]]:
    """(content, special) for ids 151643..151747 in order. ``special=False`` tokens survive decoding with
    ``skip_special_tokens`` (tool and think markers are meant to be seen)."""
    names: list[tuple[str, bool]] = [(f"<|{n}|>", True) for n in ("endoftext", "im_start", "im_end")]
    for pair in ("object_ref", "box", "quad", "vision"):
        names += [(f"<|{pair}_start|>", True), (f"<|{pair}_end|>", True)]
    names += [(f"<|{n}_pad|>", True) for n in ("vision", "image", "video")]
    names += [("<tool_call>", False), ("</tool_call>", False)]
    names += [(f"<|fim_{n}|>", False) for n in ("prefix", "middle", "suffix", "pad")]
    names += [("<|repo_name|>", False), ("<|file_sep|>", False)]
    names += [
        ("<tool_response>", False),
        ("</tool_response>", False),
        ("<think>", False),
        ("</think>", False),
    ]
    for tag in (
        "image",
        "ref",
        "box",
        "quad",
        "point",
        "slice",
        "image_id",
        "unit",
        "answer",
        "focus",
        "line",
        "perception",
        "source_image",
        "image_save_to",
    ):
        names += [(f"<{tag}>", True), (f"</{tag}>", True)]
    names += [
        (f"<|{n}|>", True)
        for n in (
            "audio_start",
            "audio",
            "audio_end",
            "spk_bos",
            "spk",
            "spk_eos",
            "tts_bos",
            "tts_eos",
            "listen",
            "speak",
            "interrupt",
        )
    ]
    for pair in ("vad", "emotion", "speed", "pitch"):
        names += [(f"<|{pair}_start|>", True), (f"<|{pair}_end|>", True)]
    names += [
        (f"<|{n}|>", True)
        for n in (
            "turn_bos",
            "turn_eos",
            "chunk_eos",
            "chunk_bos",
            "chunk_tts_bos",
            "chunk_tts_eos",
            "tts_pad",
        )
    ]
    names += [(f"<|timbre_{i}|>", True) for i in range(7, 32)]
    return names


ADDED_TOKENS: list[tuple[str, bool]] = _added_token_names()
assert len(ADDED_TOKENS) == 105, len(ADDED_TOKENS)


def byte_symbols() -> list[str]:
    """One printable unicode character per byte value: printable Latin-1 bytes stand for themselves, the
    rest are shifted above U+0100, so byte-level tokens never contain whitespace or control characters."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table: dict[int, str] = {b: chr(b) for b in keep}
    shift = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shift)
            shift += 1
    return [table[b] for b in range(256)]


_CORPUS = (
    """
The quick brown fox jumps over the lazy dog while the small cat watches from the window.
A model that listens, sees and speaks turns a question into text, and the text into a voice.
Please describe the picture in one short sentence and tell me what the person is holding.
What time is it in the city where the meeting will take place next week?
We measured the latency of the first audio chunk and the throughput of the whole system.
This test checks that every special token keeps its identifier after the tokenizer is rebuilt.
Hello there, how are you doing today? I am fine, thank you, and you?
Numbers like 0 1 2 3 4 5 6 7 8 9 and 2026 appear in dates, prices and measurements.
In the morning the weather was cold, but in the afternoon the sun came out and it became warm.
Students learn to read, to write and to count; teachers help them to think and to ask questions.
The service streams tokens to the client as soon as they are generated, one chunk at a time.
Music, speech and noise are all sounds, but only speech carries words that we can transcribe.
def main(argv): return run(parse(argv)) if argv else print("usage: tool [options] file")
import json; data = json.loads(text); print(data["name"], data.get("value", None))
"""
    * 3
)


def _learn_corpus_merges(symbols: list[str], limit: int) -> list[tuple[str, str]]:
    """Classic BPE on the built-in corpus: repeatedly merge the most frequent adjacent pair."""
    import regex  # installed with transformers/tokenizers tooling; same engine as the split pattern

    to_sym = {i: s for i, s in enumerate(symbols)}
    words = Counter(
        tuple(to_sym[b] for b in piece.encode("utf-8")) for piece in regex.findall(SPLIT_PATTERN, _CORPUS)
    )
    merges: list[tuple[str, str]] = []
    while len(merges) < limit:
        pairs: Counter[tuple[str, str]] = Counter()
        for word, freq in words.items():
            for a, b in zip(word, word[1:], strict=False):
                pairs[(a, b)] += freq
        if not pairs:
            break
        (a, b), freq = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        if freq < 2:
            break
        merges.append((a, b))
        merged: Counter[tuple[str, ...]] = Counter()
        for word, f in words.items():
            out: list[str] = []
            i = 0
            while i < len(word):
                if i + 1 < len(word) and word[i] == a and word[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += f
        words = merged
    return merges


def build_base_vocab() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """The 151,643-entry base vocabulary and its merge list (deterministic, no randomness involved)."""
    symbols = byte_symbols()
    tokens: list[str] = list(symbols)
    seen = set(tokens)
    merges: list[tuple[str, str]] = []
    target = BASE_VOCAB_SIZE - 1  # one slot is the literal <unk>

    def add(a: str, b: str) -> None:
        if a + b not in seen and len(tokens) < target:
            seen.add(a + b)
            tokens.append(a + b)
            merges.append((a, b))

    for a, b in _learn_corpus_merges(symbols, limit=3000):
        add(a, b)
    # Two-byte tokens: every ASCII pair, and every well-formed two-byte UTF-8 character.
    for first in range(128):
        for second in range(128):
            add(symbols[first], symbols[second])
    for lead in range(0xC2, 0xE0):
        for cont in range(0x80, 0xC0):
            add(symbols[lead], symbols[cont])
    # Longer tokens: extend text-like tokens by one ASCII letter/digit, breadth first.
    to_byte = {s: b for b, s in enumerate(symbols)}
    extenders = [symbols[b] for b in range(128) if chr(b).isalnum()]
    cursor = 0
    while len(tokens) < target:
        left = tokens[cursor]
        cursor += 1
        if _is_text(bytes(to_byte[c] for c in left)):
            for c in extenders:
                add(left, c)
    vocab: dict[str, int] = {}
    next_id = 0
    for tok in tokens:
        if next_id == UNK_ID:
            next_id += 1
        vocab[tok] = next_id
        next_id += 1
    vocab[UNK_TOKEN] = UNK_ID
    assert len(vocab) == BASE_VOCAB_SIZE and max(vocab.values()) == BASE_VOCAB_SIZE - 1
    return vocab, merges


def build_tokenizer() -> tuple[Any, dict[str, int], list[tuple[str, str]]]:
    """A ``tokenizers.Tokenizer`` with the base vocab plus the 106 added tokens at their real ids."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
    )

    vocab, merges = build_base_vocab()
    tok = Tokenizer(
        models.BPE(
            vocab=vocab, merges=merges, dropout=None, unk_token=None, fuse_unk=False, byte_fallback=False
        )
    )
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    # <unk> first: it already has base id 128244; then the rest land at 151643.. in order.
    added = [(UNK_TOKEN, True), *ADDED_TOKENS]
    tok.add_tokens([AddedToken(c, special=s, normalized=False) for c, s in added])
    for i, (content, _) in enumerate(ADDED_TOKENS):
        got = tok.token_to_id(content)
        if got != BASE_VOCAB_SIZE + i:
            raise RuntimeError(f"added token {content!r} landed at id {got}, expected {BASE_VOCAB_SIZE + i}")
    if tok.token_to_id(UNK_TOKEN) != UNK_ID:
        raise RuntimeError(f"<unk> landed at id {tok.token_to_id(UNK_TOKEN)}, expected {UNK_ID}")
    return tok, vocab, merges


def _is_text(raw: bytes) -> bool:
    """Whether a byte string is complete UTF-8 without control characters (tabs/newlines allowed)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return not any((ord(ch) < 0x20 and ch not in "\t\n\r") or ord(ch) == 0x7F for ch in text)


def _bad_token_ids(vocab: dict[str, int], symbols: list[str]) -> list[int]:
    """Base tokens that cannot be text on their own: incomplete UTF-8 fragments and control bytes.
    Duplex decoding forbids these ids (docs/model.md, Duplex)."""
    to_byte = {s: b for b, s in enumerate(symbols)}
    bad: list[int] = []
    for token, idx in vocab.items():
        if token == UNK_TOKEN:
            continue
        if not _is_text(bytes(to_byte[c] for c in token)):
            bad.append(idx)
    return sorted(bad)


def _token_entry(content: str, special: bool) -> dict[str, Any]:
    return {
        "content": content,
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
        "special": special,
    }


def write_tokenizer_files(out_dir: Path) -> int:
    """Write tokenizer.json, vocab.json, merges.txt, added_tokens.json, special_tokens_map.json and
    tokenizer_config.json; returns the total number of entries (151,748)."""
    tok, vocab, merges = build_tokenizer()
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False, separators=(",", ":")))
    (out_dir / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    added = [(UNK_TOKEN, UNK_ID, True)] + [
        (c, BASE_VOCAB_SIZE + i, s) for i, (c, s) in enumerate(ADDED_TOKENS)
    ]
    (out_dir / "added_tokens.json").write_text(
        json.dumps({c: i for c, i, _ in sorted(added, key=lambda x: x[0])}, indent=2, ensure_ascii=False)
        + "\n"
    )
    # Like the real file: <unk> plus the MiniCPM additions from <image> on.
    extra_special = [UNK_TOKEN] + [c for c, i, s in added if s and i >= 151669]

    def plain(content: str) -> dict[str, Any]:
        entry = _token_entry(content, True)
        entry.pop("special")
        return entry

    specials_map: dict[str, Any] = {"additional_special_tokens": [plain(c) for c in extra_special]}
    for key, content in (
        ("bos_token", "<|im_start|>"),
        ("eos_token", "<|im_end|>"),
        ("pad_token", "<|endoftext|>"),
        ("unk_token", UNK_TOKEN),
    ):
        specials_map[key] = plain(content)
    (out_dir / "special_tokens_map.json").write_text(json.dumps(specials_map, indent=2) + "\n")
    config = {
        "tokenizer_class": "MiniCPMOTokenizerFast",
        "auto_map": {"AutoTokenizer": ["tokenization_minicpmo_fast.MiniCPMOTokenizerFast", None]},
        "add_bos_token": False,
        "add_prefix_space": False,
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": UNK_TOKEN,
        "additional_special_tokens": extra_special,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "model_max_length": 131072,
        "split_special_tokens": False,
        "added_tokens_decoder": {str(i): _token_entry(c, s) for c, i, s in added},
        "bad_token_ids": _bad_token_ids(vocab, byte_symbols()),
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    size: int = tok.get_vocab_size(with_added_tokens=True)
    return size
