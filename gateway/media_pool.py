"""A bounded pool for media decoding, so that Pillow / soundfile / PyAV never run on the event loop.

Decoding an image, an audio file or a video is CPU work of up to seconds. The gateway's event loop must
keep answering ``/health`` and other requests meanwhile, and a burst of media requests must not queue
without bound. The pool runs decoders on :data:`MEDIA_WORKERS` threads (the decoders release the GIL in
their C code) and admits at most :data:`MEDIA_MAX_PENDING` parts at once, running or waiting; a part over
that is refused with 503 ``media_queue_full`` and ``Retry-After: 1`` instead of waiting.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from gateway.media import MediaError

MEDIA_WORKERS = 4
MEDIA_MAX_PENDING = 256  # parts; a single request may carry up to 64 images + 64 audios (MediaLimits)
T = TypeVar("T")


class MediaPool:
    """Threads for decoders with an admission bound; used only from the event loop thread."""

    def __init__(self, workers: int = MEDIA_WORKERS, max_pending: int = MEDIA_MAX_PENDING) -> None:
        self.workers = workers
        self.max_pending = max_pending
        self.pending = 0
        self._executor: ThreadPoolExecutor | None = None

    def _pool(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self.workers, thread_name_prefix="media-decode")
        return self._executor

    async def run(self, fn: Callable[..., T], *args: object, param: str) -> T:
        """``fn(*args)`` on a worker thread; 503 (``param`` named) when the pool is full."""
        if self.pending >= self.max_pending:
            raise MediaError(
                503,
                f"{param}: the media decoders are busy ({self.max_pending} parts pending); retry shortly",
                param,
                "media_queue_full",
                headers={"Retry-After": "1"},
            )
        self.pending += 1
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._pool(), functools.partial(fn, *args))
        finally:
            self.pending -= 1


MEDIA_POOL = MediaPool()
