"""`kvpack demo`: the main job on the embedded default (lands with the serving issue)."""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("demo", help="run the cold/warm/miss bench on the demo model")
    p.set_defaults(func=run)


def run(args) -> int:
    print("kvpack demo: not yet — the serving issue (#4) brings the bench; see README.")
    return 0
