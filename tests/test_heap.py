"""services.common.heap: the start-up heap leaves the GC's full passes (and the servers do it once)."""

from __future__ import annotations

import gc
import inspect

from gateway import app as gateway_app
from services.common import grpc_server
from services.common.heap import freeze_startup_heap


def test_freeze_moves_live_objects_to_the_permanent_generation() -> None:
    keep = [object() for _ in range(1000)]  # noqa: F841 (alive across the freeze)
    try:
        frozen = freeze_startup_heap()
        assert frozen >= 1000 and gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()  # the test process keeps collecting its own garbage
    assert gc.get_freeze_count() == 0


def test_servers_freeze_before_taking_traffic() -> None:
    """Each stage's ``serve_forever`` freezes before ``server.start()``; the gateway before uvicorn runs."""
    stage = inspect.getsource(grpc_server.serve_forever)
    assert stage.index("freeze_startup_heap()") < stage.index("await server.start()")
    gateway = inspect.getsource(gateway_app.main)
    assert gateway.index("freeze_startup_heap()") < gateway.index("server.run()")
