"""A second stream on the default device, for work that runs beside the thread's own.

Joining a resident cut's blocks into a slot's caches is one copy per layer's keys and one
per its values, on one stream by default: one core copies while the other idles. With
the values joined on this stream the two copies run at once: a resident install of the
demo model's 7,936-token cut (366 MB) took 119.5 ms on one stream and 68.9 ms on two
(`benchmarks/read_path.py --depth 7936`, engine/README.md).

MLX streams belong to the thread that made them (another thread's arrays or streams
fail to evaluate there), so each thread that asks gets its own, made once and kept for
the thread's life.

MLX (0.32) tears a thread's streams down only when asked (`mx.clear_streams`): a thread
that ran MLX work and ends without it can take the process down at exit ("terminate
called without an active exception", seen once in the suite's run of
examples/generate.py). So every thread that runs the engine calls `release` last, and
the main thread's runs at exit.
"""

from __future__ import annotations

import atexit
import threading

import mlx.core as mx

_local = threading.local()


def side() -> mx.Stream:
    """This thread's second stream on the default device."""
    stream = getattr(_local, "stream", None)
    if stream is None:
        stream = _local.stream = mx.new_stream(mx.default_device())
    return stream


def release() -> None:
    """Destroy every stream this thread made, its default one and `side()` included. Call
    it last on a thread that ran MLX work; the thread runs none after it."""
    _local.__dict__.pop("stream", None)
    mx.clear_streams()


# The main thread's, at exit: atexit runs handlers last-registered first, so this runs
# before whatever MLX registered when it was imported above.
atexit.register(release)
