"""engine.streams.side: one second stream per thread, usable there and only there."""

from __future__ import annotations

import threading

import mlx.core as mx

from engine import streams


def test_each_thread_gets_a_side_stream_of_its_own_that_evaluates_there():
    mine = streams.side()
    assert streams.side() is mine  # made once per thread
    assert mine != mx.default_stream(mx.default_device())
    assert mx.sum(mx.ones((4,), stream=mine), stream=mine).item() == 4
    seen: dict[str, object] = {}

    def other() -> None:
        theirs = streams.side()
        seen["stream"] = theirs
        seen["sum"] = mx.sum(mx.ones((3,), stream=theirs), stream=theirs).item()

    worker = threading.Thread(target=other)
    worker.start()
    worker.join()
    assert seen["sum"] == 3  # a stream made on the main thread would fail to run there
    assert seen["stream"] != mine
