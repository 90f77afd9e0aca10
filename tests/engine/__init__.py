"""Engine tests. Importing `engine` here, before any test module imports mlx.core, lets
engine/blas.py preload a fast BLAS for the whole package (see engine/README.md)."""

import engine  # noqa: F401
