"""engine — compute: MLX models, slots, aligned prefill, decode, plane export, restore."""

from engine import blas as _blas

# Must run before mlx.core is first imported (see engine/blas.py); a no-op afterwards.
_blas.enable()
