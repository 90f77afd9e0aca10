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


def test_release_destroys_the_streams_the_thread_made():
    """After release a thread's streams are gone: its old side stream no longer runs
    there (MLX refuses it), so release did tear them down rather than merely forget them."""
    seen: dict[str, object] = {}

    def worker() -> None:
        old = streams.side()
        seen["before"] = mx.sum(mx.ones((2,), stream=old), stream=old).item()
        streams.release()
        try:
            mx.eval(mx.ones((2,), stream=old))
        except RuntimeError as e:
            seen["after"] = e

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen["before"] == 2
    assert isinstance(seen.get("after"), RuntimeError)


def released_on(monkeypatch) -> list[str]:
    """The names of the threads that call streams.release from now on (it still runs)."""
    names: list[str] = []
    real = streams.release

    def recording() -> None:
        names.append(threading.current_thread().name)
        real()

    monkeypatch.setattr(streams, "release", recording)
    return names
