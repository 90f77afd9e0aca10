"""The publication bench: what publishing a cold request's cuts costs the request itself.

- run: one vault (a fresh data dir: SQLite and a local directory, unless the storage
  flags name others), one prompt per depth, and for each depth `rounds` pairs of legs in
  alternating order (off, on, on, off, ...), so a drift of the machine over the run falls
  on both sides. Run id: <UTC time>-<random hex>.
- leg: one Service opened in this process with publication on or off (the `publish`
  setting; everything else equal), warmed by one short request in a namespace of its
  own, then ONE cold request of exactly `depth` tokens in a fresh tenant namespace (its
  identity and chunk-id key are new, so nothing can serve it and every chunk is new to
  the store), greedy, `max_tokens` generated. In-process measures what `kvpack serve`
  does: the same engine thread, background worker, deferred publication worker and
  storage loop, minus HTTP, which is the same with publication on or off.
- figures per leg: cold prefill seconds (request start to first token: lookup, prefill,
  the snapshots taken at boundaries, the first decode step), decode tokens/s (first to
  last token), publication seconds after the response (until every queue drained),
  process CPU seconds (all threads) during the request and until publication drained,
  chunks sealed (the service's counter) and chunks new to the store (chunk rows of the
  catalog, before and after).
- target (issue: "Publication on vs off"): median decode tokens/s on >= 95% of off,
  median cold prefill seconds on <= 105% of off, and on every "on" leg chunks sealed =
  chunks new to the store.
- validity gate: every leg cold (served by no tier), generating at least `min_tokens`,
  and all legs of a depth the same output; the "off" legs store nothing and every "on"
  leg's prompt, asked again, is served from a tier (publication worked). An invalid run
  is never reported as meeting the target.
- receipt: the run as JSON, <receipts dir>/publication-<run id>.json, never overwritten.
"""

from __future__ import annotations

import secrets
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from catalog.models import ChunkRow
from kvpack.bench.figures import num, shown
from kvpack.bench.serve import write_receipt
from kvpack.config import Settings
from kvpack.service.service import Completion, CompletionRequest, Service

RECEIPT_VERSION = 1
DECODE_RATIO_MIN = 0.95
PREFILL_RATIO_MAX = 1.05
WARMUP_TOKENS = 256


@dataclass(frozen=True)
class Plan:
    settings: Settings  # the vault every leg publishes into
    model: str = "smollm2"
    depths: tuple[int, ...] = (2048,)
    max_tokens: int = 128
    min_tokens: int = 16
    rounds: int = 1  # pairs of legs (on, off) per depth
    receipts_dir: Path = Path("receipts")


@dataclass(frozen=True)
class Leg:
    publish: bool
    namespace: str
    tier: str
    prompt_tokens: int
    generated: int
    prefill_s: float  # request start to first token
    engine_prefill_s: float  # the service's own prefill seconds (publication excluded)
    decode_tokens_per_s: float | None
    publication_after_s: float  # after the response, until every queue drained
    cpu_request_s: float
    cpu_total_s: float
    chunks_sealed: int
    chunks_already_stored: int
    chunks_new: int
    again_tier: str | None  # the prompt asked again ("on" legs): which tier served it
    output: list[int]


def prompt_tokens(tokenizer: Any, depth: int, *, seed: int) -> list[int]:
    """Exactly `depth` token ids of plain numbered prose (deterministic per seed)."""
    text, n = [], 0
    while True:
        text.append(f"Entry {seed}.{n}: the survey logged station {n * 7 % 101} at dawn. ")
        n += 1
        if n % 64 == 0:
            ids = tokenizer.encode("".join(text))
            if len(ids) >= depth:
                return list(ids[:depth])


def _chunk_rows(service: Service) -> int:
    with Session(service.vault.db) as s:
        return int(s.scalar(select(func.count()).select_from(ChunkRow)) or 0)


def _counted(service: Service, name: str, namespace: str) -> int:
    return int(service.accounting.value(name, namespace=namespace))


def run_leg(plan: Plan, tokens: list[int], *, publish: bool, run_id: str, n: int) -> Leg:
    service = Service.open(replace(plan.settings, publish=publish), model=plan.model)
    try:
        warm = f"warm-{run_id}-{n}"
        service.complete(CompletionRequest(tokens=tokens[:WARMUP_TOKENS], max_tokens=8,
                                           namespace=warm))  # fmt: skip
        service.flush(None)
        namespace = f"bench-{run_id}-{n}"
        rows = _chunk_rows(service)
        stamps: list[float] = []
        cpu0, t0 = time.process_time(), time.perf_counter()
        done: Completion = service.complete(
            CompletionRequest(tokens=tokens, max_tokens=plan.max_tokens, namespace=namespace),
            on_token=lambda _d: stamps.append(time.perf_counter()),
        )
        t1, cpu1 = time.perf_counter(), time.process_time()
        service.flush(None)
        t2, cpu2 = time.perf_counter(), time.process_time()
        decode = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else None
        sealed = _counted(service, "kvpack_chunks_sealed_total", namespace)
        stored = _counted(service, "kvpack_chunks_already_stored_total", namespace)
        new = _chunk_rows(service) - rows
        again = None
        if publish:
            asked = service.complete(
                CompletionRequest(tokens=tokens, max_tokens=1, namespace=namespace)
            )
            again = asked.tier
            service.flush(None)
        return Leg(
            publish=publish,
            namespace=namespace,
            tier=done.tier,
            prompt_tokens=done.prompt_tokens,
            generated=len(stamps),
            prefill_s=(stamps[0] if stamps else t1) - t0,
            engine_prefill_s=done.prefill_seconds,
            decode_tokens_per_s=decode,
            publication_after_s=t2 - t1,
            cpu_request_s=cpu1 - cpu0,
            cpu_total_s=cpu2 - cpu0,
            chunks_sealed=sealed,
            chunks_already_stored=stored,
            chunks_new=new,
            again_tier=again,
            output=list(done.tokens),
        )
    finally:
        service.close(timeout=600)


def judge(depth: int, legs: Sequence[Leg], min_tokens: int) -> dict[str, Any]:
    """One depth's figures, ratios, validity and whether the target is met."""
    on = [leg for leg in legs if leg.publish]
    off = [leg for leg in legs if not leg.publish]
    problems = []
    for leg in legs:
        name = f"{'on' if leg.publish else 'off'} leg {leg.namespace}"
        if leg.tier != "none":
            problems.append(f"{name} was served by {leg.tier}, not cold")
        if leg.generated < min_tokens:
            problems.append(f"{name} generated {leg.generated} < {min_tokens} tokens")
    if len({tuple(leg.output) for leg in legs}) > 1:
        problems.append("the legs disagree on the output")
    if any(leg.chunks_sealed or leg.chunks_new for leg in off):
        problems.append("publication off stored chunks")
    if any(leg.again_tier in (None, "none") for leg in on):
        problems.append("an 'on' leg's prompt, asked again, was served by no tier")

    def median(values: list[float | None]) -> float | None:
        got = [v for v in values if v is not None]
        return statistics.median(got) if got else None

    def side(group: Sequence[Leg]) -> dict[str, float | None]:
        return {
            "prefill_s": median([g.prefill_s for g in group]),
            "engine_prefill_s": median([g.engine_prefill_s for g in group]),
            "decode_tokens_per_s": median([g.decode_tokens_per_s for g in group]),
            "publication_after_s": median([g.publication_after_s for g in group]),
            "cpu_request_s": median([g.cpu_request_s for g in group]),
            "cpu_total_s": median([g.cpu_total_s for g in group]),
        }

    s_on, s_off = side(on), side(off)

    def ratio(key: str) -> float | None:
        a, b = s_on[key], s_off[key]
        return None if a is None or not b else a / b

    decode, prefill = ratio("decode_tokens_per_s"), ratio("prefill_s")
    sealed_is_new = all(leg.chunks_sealed == leg.chunks_new for leg in on)
    valid = not problems
    return {
        "depth": depth,
        "on": s_on,
        "off": s_off,
        "decode_ratio": decode,
        "prefill_ratio": prefill,
        "chunks": [[leg.chunks_sealed, leg.chunks_already_stored, leg.chunks_new] for leg in on],
        "sealed_equals_new": sealed_is_new,
        "valid": valid,
        "problems": problems,
        "target_met": valid
        and decode is not None
        and prefill is not None
        and decode >= DECODE_RATIO_MIN
        and prefill <= PREFILL_RATIO_MAX
        and sealed_is_new,
        "legs": [asdict(leg) for leg in legs],
    }


def run(plan: Plan, *, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every depth's legs, judged, and the receipt written; returns the receipt."""
    from engine.models import load_model

    run_id = f"{datetime.now(UTC):%Y%m%dT%H%M%SZ}-{secrets.token_hex(4)}"
    tokenizer = load_model(plan.model, alignment=plan.settings.alignment).tokenizer
    depths = []
    n = 0
    for depth in plan.depths:
        tokens = prompt_tokens(tokenizer, depth, seed=depth)
        legs = []
        for r in range(plan.rounds):
            order = (False, True) if r % 2 == 0 else (True, False)
            for publish in order:
                n += 1
                log(f"depth {depth}: round {r + 1}/{plan.rounds}, publication "
                    f"{'on' if publish else 'off'} ...")  # fmt: skip
                legs.append(run_leg(plan, tokens, publish=publish, run_id=run_id, n=n))
        depths.append(judge(depth, legs, plan.min_tokens))
    receipt = {
        "version": RECEIPT_VERSION,
        "kind": "publication",
        "run_id": run_id,
        "model": plan.model,
        "max_tokens": plan.max_tokens,
        "rounds": plan.rounds,
        "store_url": str(plan.settings.store_url),
        "targets": {"decode_ratio_min": DECODE_RATIO_MIN, "prefill_ratio_max": PREFILL_RATIO_MAX},
        "depths": depths,
    }
    path = write_receipt(plan.receipts_dir, f"publication-{run_id}", receipt)  # never overwritten
    receipt["path"] = str(path)
    return receipt


def format_table(receipt: dict[str, Any]) -> str:
    """The figures of a receipt as a table, one row per depth."""
    head = (
        f"{'depth':>6} {'prefill s off/on':>17} {'ratio':>6} {'decode tok/s off/on':>20} "
        f"{'ratio':>6} {'CPU s off/on':>13} {'pub s':>6} {'sealed/stored/new':>18} valid target"
    )
    lines = [head]
    for d in receipt["depths"]:
        on, off = d["on"], d["off"]
        chunks = ",".join(f"{s}/{a}/{n}" for s, a, n in d["chunks"])
        lines.append(
            f"{d['depth']:>6} {num(off['prefill_s']):>8}/{num(on['prefill_s']):<8} "
            f"{shown(d['prefill_ratio'], '<=', PREFILL_RATIO_MAX, 3):>6} "
            f"{num(off['decode_tokens_per_s'], '.1f'):>10}/"
            f"{num(on['decode_tokens_per_s'], '.1f'):<9} "
            f"{shown(d['decode_ratio'], '>=', DECODE_RATIO_MIN, 3):>6} "
            f"{num(off['cpu_total_s'], '.1f'):>6}/{num(on['cpu_total_s'], '.1f'):<6} "
            f"{num(on['publication_after_s']):>6} {chunks:>18} "
            f"{'yes' if d['valid'] else 'NO'} {'met' if d['target_met'] else 'MISSED'}"
        )
        lines += [f"  invalid: {p}" for p in d["problems"]]
    lines.append(f"receipt: {receipt['path']}")
    return "\n".join(lines)
