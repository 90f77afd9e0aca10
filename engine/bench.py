"""Engine benchmark: what a restore costs against the prefill it replaces.

For each depth, one run on one model: a cold aligned prefill, an export of the slot (a
Snapshot), its planes encoded, a restore from the in-memory snapshot and one from the
planes (decode + restore), and — for the same cache — mlx-lm's save_prompt_cache /
load_prompt_cache through a temporary file (the load is evaluated, since mx.load is lazy).

Leg validity gate: each restored slot must hold the cold run's logits bit for bit, or the
row is marked invalid. Miss control: the cold run's logits must differ from those of an
unrelated prompt of the same depth's first block (the warm-up), so that equality is
evidence and not an artefact of comparing a thing with itself.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from engine import blas
from engine.errors import LogitsMissing
from engine.format import encode
from engine.slots import Slot, SlotPool, cache_arrays

DEPTHS = (256, 512, 1024, 2048)
_TEXT = (
    "Paragraph {i}. A vault for language-model prefix state keeps the key/value cache and "
    "the final logits of prompt number {i}, sealed and addressed by content, so that a "
    "restarted server never pays twice for the same system prompt. "
)


@dataclass(frozen=True)
class Row:
    depth: int
    prefill_s: float
    snapshot_ms: float
    encode_ms: float
    restore_mem_ms: float
    restore_parts_ms: float
    planes_mib: float
    save_ms: float
    load_ms: float
    file_mib: float
    valid: bool


def bench_tokens(tokenizer: Any, n: int, *, salt: str = "") -> list[int]:
    """`n` tokens of numbered prose (no repeats long enough to look like one prompt)."""
    tokens: list[int] = []
    i = 0
    while len(tokens) < n:
        tokens += tokenizer.encode(salt + _TEXT.format(i=i))
        i += 1
    return tokens[:n]


def _logits(slot: Slot) -> bytes:
    """The slot's last logits as bytes, to compare restores bit for bit."""
    logits = slot.logits
    if logits is None:
        raise LogitsMissing(slot.depth)
    return bytes(memoryview(logits))  # type: ignore[arg-type]  # mlx stubs lack __buffer__


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def run(
    loaded: Any,
    *,
    depths: Sequence[int] = DEPTHS,
    log: Callable[[str], None] = print,
) -> list[Row]:
    pool = SlotPool(loaded, num_slots=2)
    cold, warm = pool.slot(0), pool.slot(1)
    # Warm-up (first-call allocations) doubles as the miss control: an unrelated prompt.
    warm.prefill(bench_tokens(loaded.tokenizer, pool.alignment, salt="Unrelated. "))
    control = _logits(warm)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvpack-bench-") as tmp:
        path = str(Path(tmp) / "cache.safetensors")
        for depth in depths:
            tokens = bench_tokens(loaded.tokenizer, depth)
            cold.reset()
            _, prefill_s = _timed(lambda: cold.prefill(tokens))  # noqa: B023
            expected = _logits(cold)
            snap, snap_s = _timed(cold.export)
            planes, enc_s = _timed(lambda: encode(snap))  # noqa: B023
            warm.reset()
            _, mem_s = _timed(lambda: warm.restore(snap, prompt=tokens))  # noqa: B023
            ok = _logits(warm) == expected
            warm.reset()
            _, parts_s = _timed(lambda: warm.restore(planes, prompt=tokens))  # noqa: B023
            ok = ok and _logits(warm) == expected and expected != control
            _, save_s = _timed(lambda: save_prompt_cache(path, cold.state.cache))  # noqa: B023

            def load() -> None:
                mx.eval(cache_arrays(load_prompt_cache(path)))  # noqa: B023

            _, load_s = _timed(load)
            row = Row(
                depth=depth,
                prefill_s=prefill_s,
                snapshot_ms=snap_s * 1e3,
                encode_ms=enc_s * 1e3,
                restore_mem_ms=mem_s * 1e3,
                restore_parts_ms=parts_s * 1e3,
                planes_mib=planes.nbytes / 2**20,
                save_ms=save_s * 1e3,
                load_ms=load_s * 1e3,
                file_mib=Path(path).stat().st_size / 2**20,
                valid=ok,
            )
            rows.append(row)
            log(format_row(row))
    return rows


HEADER = (
    f"{'depth':>6} {'prefill s':>9} {'snapshot ms':>11} {'encode ms':>9} "
    f"{'restore ms':>10} {'decode+restore ms':>17} {'planes MiB':>10} "
    f"{'mlx-lm save ms':>14} {'mlx-lm load ms':>14} {'file MiB':>8} {'valid':>5}"
)


def format_row(r: Row) -> str:
    return (
        f"{r.depth:>6} {r.prefill_s:>9.2f} {r.snapshot_ms:>11.2f} {r.encode_ms:>9.1f} "
        f"{r.restore_mem_ms:>10.1f} {r.restore_parts_ms:>17.1f} {r.planes_mib:>10.1f} "
        f"{r.save_ms:>14.1f} {r.load_ms:>14.1f} {r.file_mib:>8.1f} {'yes' if r.valid else 'NO':>5}"
    )


def main(model: str = "smollm2", *, depths: Sequence[int] = DEPTHS, alignment: int = 256) -> int:
    from engine.models import load_model

    loaded = load_model(model, alignment=alignment)
    status = blas.status()
    print(
        f"model {loaded.name} ({loaded.num_params:,} params, {loaded.layout.dtype}), A={alignment}"
    )
    print(f"blas: {status.library or 'MLX bundled'} ({status.reason})")
    print(HEADER)
    rows = run(loaded, depths=depths)
    if not all(r.valid for r in rows):
        print("INVALID: a restored slot did not reproduce the cold run's logits bit for bit")
        return 1
    return 0
