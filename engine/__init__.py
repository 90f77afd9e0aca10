"""engine — compute: MLX models, slots, aligned prefill, decode, plane export, restore.

Callers use engine.models (load_model, LoadedModel), engine.slots (SlotPool, Slot),
engine.sampling, engine.state (Snapshot, Planes, Part, part_buffer), engine.format
(encode, decode), engine.intake (Intake, from Slot.intake), engine.identity,
engine.errors and engine.interop (cuts as mlx-lm's own caches and back); engine.codec is
the engine's own: the plane format and one module per cache kind.
"""

from engine import blas as _blas
from engine import memory as _memory

# Must run before mlx.core is first imported (see engine/blas.py); a no-op afterwards.
_blas.enable()
# Before threads get malloc arenas of their own (see engine/memory.py).
_memory.keep_freed()
