"""kvpack — the product: reuse ladder, hit accounting, economics, service API, CLI, bench."""

# engine first: it loads the fast BLAS, which only works before mlx.core is imported.
import engine  # noqa: F401
