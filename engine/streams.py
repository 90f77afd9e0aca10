"""A second stream on the default device, for work that runs beside the thread's own.

Joining a resident cut's blocks into a slot's caches is one copy per layer's keys and one
per its values, on one stream by default: one core copies while the other idles. With
the values joined on this stream the two copies run at once: a resident install of the
demo model's 7,936-token cut (366 MB) took 119.5 ms on one stream and 68.9 ms on two
(`benchmarks/read_path.py --depth 7936`, engine/README.md).

MLX streams belong to the thread that made them (another thread's arrays or streams
fail to evaluate there), so each thread that asks gets its own, made once and kept for
the thread's life.
"""

from __future__ import annotations

import threading

import mlx.core as mx

_local = threading.local()


def side() -> mx.Stream:
    """This thread's second stream on the default device."""
    stream = getattr(_local, "stream", None)
    if stream is None:
        stream = _local.stream = mx.new_stream(mx.default_device())
    return stream
