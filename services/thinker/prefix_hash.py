"""Content addresses of KV blocks for automatic prefix caching.

A full block of ``block_size`` positions is named by a hash chain: ``h_i = H(h_{i-1}, keys of block i)``
with ``h_{-1}`` empty, so a hash names the whole prefix up to the block's end, never the block alone
(the same tokens at another offset or after another history are a different key; rotary positions and
attention context are both in the key by construction).

A position's key is its token id, except inside a media span: image and audio rows carry the same
placeholder id whatever the picture or sound, so there the key is the media's content digest and the
row's offset inside the span (:class:`MediaSpan`, filled in by the processor from the media bytes). A
row whose embedding is neither its token's nor a keyed media row's cannot be named: the work item then
says so (``WorkItem.embeds`` without ``WorkItem.media``) and the sequence stops registering blocks
from there on (``Sequence.hash_limit``).

BLAKE2b with a 16-byte digest: collision-safe for any realistic cache, and cheap (a block is 16 ids).
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass


@dataclass(frozen=True)
class MediaSpan:
    """Rows ``[start, end)`` of a work item (or, on a sequence, absolute positions) embedded from media.

    ``digest`` names the media and everything that shapes its rows (bytes, slicing); row ``start + k`` is
    keyed by ``(digest, k + offset)``, where ``offset`` is the row's index inside the span's full extent
    when a span was cut (kept with the span, so a cut piece keys the same as the original rows).
    """

    start: int
    end: int
    digest: bytes
    offset: int = 0

    def shifted(self, by: int) -> MediaSpan:
        return MediaSpan(self.start + by, self.end + by, self.digest, self.offset)


def media_digest(*parts: bytes | str | int) -> bytes:
    """A media item's content digest from its bytes and the settings that change its embedding rows."""
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        if isinstance(part, int):
            part = str(part)
        if isinstance(part, str):
            part = part.encode()
        h.update(struct.pack("<Q", len(part)))
        h.update(part)
    return h.digest()


def block_hash(parent: bytes, tokens: list[int], start: int, media: list[MediaSpan]) -> bytes:
    """Hash of the block holding absolute positions ``[start, start + len(tokens))`` after ``parent``.

    ``media`` are the sequence's spans in absolute positions; the overlapping ones enter the hash.
    """
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    end = start + len(tokens)
    for span in media:
        lo, hi = max(span.start, start), min(span.end, end)
        if lo < hi:
            h.update(struct.pack("<qqq", lo - start, hi - start, lo - span.start + span.offset))
            h.update(span.digest)
    return h.digest()


def chain_hashes(
    tokens: list[int],
    block_size: int,
    media: list[MediaSpan],
    *,
    limit: int | None = None,
    parent: bytes = b"",
) -> list[bytes]:
    """Hashes of every full block of ``tokens`` (positions from 0) that ends at or before ``limit``."""
    stop = len(tokens) if limit is None else min(len(tokens), limit)
    out: list[bytes] = []
    for b in range(stop // block_size):
        parent = block_hash(parent, tokens[b * block_size : (b + 1) * block_size], b * block_size, media)
        out.append(parent)
    return out
