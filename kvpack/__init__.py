"""kvpack — the product: reuse ladder, hit accounting, economics, service API, CLI, bench."""
