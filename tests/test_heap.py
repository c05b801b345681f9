"""services.common.heap: the start-up heap leaves the GC's full passes, collections are timed, and the
servers prepare the heap once, before they take traffic."""

from __future__ import annotations

import gc
import inspect

import pytest

from gateway import app as gateway_app
from services.common import grpc_server, heap


@pytest.fixture
def clean_gc():  # noqa: ANN201
    callbacks = list(gc.callbacks)
    yield
    gc.unfreeze()  # the test process keeps collecting its own garbage
    gc.callbacks[:] = callbacks


def _pauses(generation: str) -> float:
    for metric in heap.GC_PAUSE.collect():
        for sample in metric.samples:
            if sample.name.endswith("_count") and sample.labels.get("generation") == generation:
                return sample.value
    return 0.0


def test_prepare_freezes_live_objects_and_times_collections(clean_gc: None) -> None:
    keep = [object() for _ in range(1000)]
    before = _pauses("2")
    frozen = heap.prepare_heap_for_serving()
    # The count is the freeze's own: later it can only fall, when another thread of the test process
    # (a stage server left by an earlier test) frees a frozen object; it fell by 2 in one CI run.
    assert frozen >= len(keep) and 0 < gc.get_freeze_count() <= frozen
    assert not any(o is keep for o in gc.get_objects())  # the live list went to the permanent generation
    assert _pauses("2") == before + 1  # the freeze's own full collection was timed
    heap.prepare_heap_for_serving()  # a second call adds no second callback
    assert gc.callbacks.count(heap._on_gc) == 1


def test_freeze_can_be_turned_off(clean_gc: None) -> None:
    assert heap.prepare_heap_for_serving(freeze=False) == 0 and gc.get_freeze_count() == 0
    before = _pauses("0")
    gc.collect(0)
    assert _pauses("0") == before + 1  # still timed


def test_servers_prepare_the_heap_before_taking_traffic() -> None:
    """Each stage's ``serve_forever`` before ``server.start()``; the gateway before uvicorn runs."""
    stage = inspect.getsource(grpc_server.serve_forever)
    assert stage.index("prepare_heap_for_serving()") < stage.index("await server.start()")
    gateway = inspect.getsource(gateway_app.main)
    assert gateway.index("prepare_heap_for_serving()") < gateway.index("server.run()")
