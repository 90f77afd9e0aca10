"""mlx-lm's own caches in and out of the vault, through a Service's ladder and publication.

- prompt cache: the list of mlx-lm cache objects `make_prompt_cache(model)` returns, which
  `mlx_lm.generate` / `stream_generate` continue from (`prompt_cache=`). engine/interop.py
  turns cuts into prompt caches and back; this module puts the product around it.
- restored cache (RestoredCache): what `restore` hands out for some tokens — fresh caches
  filled with the deepest cut the tiers hold (depth 0 and fresh, empty caches when none
  does), that cut's witnessed logits when it has them, the tier that served it and what
  the restore cost.
- restore(service, tokens): the ladder without its session rung (a live slot may hold
  decoded tokens, which no cold run computes): resident, capped by durable, then durable,
  then a peer when one could serve deeper. Each candidate is loaded, verified and built
  into mlx-lm caches by the engine's restore gate and shadow build — the very steps of a
  slot restore; a durable reader is read straight into the intake whose shadow caches
  are handed out — so the first that builds is a hit of its tier, counted and billed as
  one (a refusal falls through and is counted; nothing left is a miss).
- publish(service, tokens, caches, logits=): seal the state mlx-lm computed for `tokens`
  into the vault (chunks, manifest, catalog rows; synchronously, so it is durable when
  this returns) and hold it in the resident tier. The caches pass the same gate a restore
  does (engine.interop.from_mlx_lm); the gate sees shapes, not how the values were
  computed, so publish only caches `prefill_aligned` filled from an empty or aligned cache.

When mlx-lm's generation from a restored cache is bit-identical to its cold run is
engine/interop.py's docstring: prefill_step_size equal to the alignment in both runs, a
cut at an aligned depth or at len(prompt) - 1 (ask for `prompt[:-1]`), computed cold.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from catalog.manifest import Manifest
from engine.errors import InvalidRequest, ShapeMismatch
from engine.format import encode
from engine.interop import PromptCache, from_mlx_lm, to_mlx_lm
from kvpack.service.service import Service
from kvpack.tiers.base import Ask, Cut


@dataclass
class RestoredCache:
    """mlx-lm caches holding the first `depth` tokens asked for (one per layer), the cut's
    witnessed final logits ([vocab]) or None, the tier that served it ("resident",
    "durable", "remote", or "none" with depth 0) and the seconds the restore took."""

    caches: list[Any]
    depth: int
    logits: mx.array | None
    tier: str
    restore_seconds: float


def restore(service: Service, tokens: Sequence[int], *, namespace: str) -> RestoredCache:
    """The deepest state the vault's tiers hold for `tokens`, as fresh mlx-lm caches."""
    tenant = service.tenant(namespace)
    history = tenant.pool.check_tokens(tokens)
    if not history:
        raise InvalidRequest("tokens", "nothing to look up")
    ask = Ask.of(tenant.scope, history)

    def build(cut: Cut) -> PromptCache:
        if cut.depth > len(history):  # the tiers never offer one; the gate cannot see it
            raise ShapeMismatch("depth (tokens asked for)", f"<= {len(history)}", cut.depth)
        return to_mlx_lm(tenant.pool, cut)

    found = service.ladder.restore(ask, build)
    if found is None:
        return RestoredCache(tenant.pool.loaded.make_cache(), 0, None, "none", 0.0)
    pc, receipt = found
    return RestoredCache(pc.caches, pc.depth, pc.logits, receipt.tier, receipt.restore_seconds)


def publish(
    service: Service,
    tokens: Sequence[int],
    caches: Sequence[Any],
    *,
    logits: mx.array | None,
    namespace: str,
) -> Manifest:
    """Seal mlx-lm `caches` holding `tokens` (and their final `logits`, when witnessed)
    into the vault; a RestoreRefused when they do not fit the model, the depth or the
    alignment (a non-aligned cut needs its logits). Idempotent: the same tokens again are
    the same manifest."""
    tenant = service.tenant(namespace)
    snap = from_mlx_lm(tenant.pool, caches, tokens=tokens, logits=logits)
    planes = encode(snap)
    history = tuple(tokens)
    manifest = service.vault.publish(
        tenant.scope,
        history,
        layout=planes.layout,
        parts=planes.parts,
        logits_witnessed=planes.logits_witnessed,
    )
    service.resident.hold(tenant.scope, history, planes)
    return manifest
