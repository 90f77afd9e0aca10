"""The read path through the tiers' new forms, on `tiny` (A = 64): a durable hit read
straight into the slot's intake (the CutReader), the resident tier's installable
Snapshots, and promotion of the one into the other — bit-identical to a cold run, a
resident hit that neither decodes nor hashes, parts interned once, and a store that fails
or stalls in the middle of a durable restore leaving the slot as it was."""

from __future__ import annotations

import asyncio
import threading
import time
from contextlib import contextmanager
from functools import partial
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from sqlalchemy import select

import engine.codec as codec
from cas.errors import StoreUnavailable
from catalog.models import ManifestChunkRow, ManifestRow
from engine.codec import frame
from engine.errors import PlanesInvalid, RestoreRefused
from engine.format import encode
from kvpack.config import Settings
from kvpack.service.service import Completion, CompletionRequest, Service
from kvpack.tiers.base import Ask
from kvpack.tiers.durable import CutReader
from kvpack.vault import Vault
from tests.cas.faults import Wrapper
from tests.engine.slotkit import TINY_A, prompt
from tests.kvpack.conftest import s3_settings

P = prompt(300, seed=41)  # the exact cut: five blocks (the last partial), ring, logits
R = P[: 4 * TINY_A + 20] + prompt(30, seed=42)  # shares P's aligned cut at 256, then differs
R2 = P[: 4 * TINY_A + 9] + prompt(40, seed=44)  # and another such
Q = prompt(90, seed=43)  # something else for the slot to hold first


def ask(svc: Service, tokens: list[int], namespace: str = "default") -> Completion:
    request = CompletionRequest(tokens=tokens, max_tokens=12, namespace=namespace, top_logprobs=3)
    return svc.complete(request)


def answer(c: Completion) -> tuple:
    """Everything a client sees, logprobs included (floats compared exactly)."""
    return c.tokens, c.finish_reason, c.logprobs


@pytest.mark.parametrize(
    ("tokens", "then", "depth"),
    [(P, P, len(P)), (R, R2, 4 * TINY_A)],
    ids=["exact", "aligned-ancestor"],
)
def test_cold_durable_and_promoted_resident_are_bit_identical(
    shared_settings, open_service, tokens, then, depth
):
    """Branches: durable through the reader (intake), then resident from the state that
    durable hit installed (promoted in the background; `then` reaches only that cut),
    each answering exactly the cold answer — logprobs included — at an exact cut and at
    an aligned ancestor, on the embedded default and on S3 + PostgreSQL."""
    first = open_service(shared_settings)
    assert ask(first, P).tier == "none"
    cold = ask(first, tokens, namespace="cold")  # other tenants: computed from scratch
    cold_then = ask(first, then, namespace="cold-then")
    assert cold.tier == cold_then.tier == "none"
    assert first.flush(30)
    first.close()

    svc = open_service(shared_settings)
    scope = svc.tenant("default").scope
    found = svc.durable.find(Ask.of(scope, tokens))
    assert found is not None and found.depth == depth
    loaded = svc.durable.load(found, Ask.of(scope, tokens))
    assert isinstance(loaded.cut, CutReader)
    loaded.close()  # not installed here: its fetch stops
    durable = ask(svc, tokens)
    assert (durable.tier, durable.cached_tokens) == ("durable", depth)
    assert svc.flush(30)
    held = svc.resident.find(Ask.of(scope, then).bounded(at_most=depth))
    assert held is not None and held.depth == depth  # promoted from the installed state
    resident = ask(svc, then)
    assert (resident.tier, resident.cached_tokens) == ("resident", depth)
    assert answer(durable) == answer(cold)
    assert answer(resident) == answer(cold_then)


def test_a_resident_hit_neither_decodes_nor_hashes(settings, open_service, monkeypatch):
    """Branch: the resident tier holds what the engine installs from. A hit with the
    codec's decode, frame decoding and frame hashing all made to fail still serves the
    cold answer (a decode or hash anywhere on the path would raise)."""
    svc = open_service(settings)
    cold = ask(svc, P)
    assert svc.flush(30)

    def forbidden(*args, **kwargs):
        raise AssertionError("a resident hit decoded or hashed a part")

    monkeypatch.setattr(codec, "decode", forbidden)
    monkeypatch.setattr(frame, "decode_part", forbidden)
    monkeypatch.setattr(frame, "blake3", SimpleNamespace(blake3=forbidden))  # frames' hash
    warm = ask(svc, P)
    assert (warm.tier, warm.cached_tokens) == ("resident", len(P))
    assert answer(warm) == answer(cold)


def test_cuts_that_share_parts_hold_them_once_and_decode_only_the_new(settings, open_service):
    """Branch: interning by the digest each frame carries. Holding the encoder's Planes of
    two cuts on one history decodes each part once: the second decodes only its own new
    parts, shares the common blocks as the same objects, and the budget counts them once."""
    svc = open_service(settings, resident_budget_bytes=0)  # nothing held by the service
    slot = svc.tenant("default").pool.slot(0)
    slot.reset()
    cuts = {}
    slot.prefill(P, on_boundary=lambda d: cuts.setdefault(d, encode(slot.export())))
    scope, tier = svc.tenant("default").scope, svc.resident
    tier.set_budget(1 << 30)
    decoded: list[str] = []
    real = frame.decode_part

    def counting(role, data, **kw):
        decoded.append(role)
        return real(role, data, **kw)

    frame.decode_part = counting  # type: ignore[assignment]
    try:
        short = tier.hold(scope, P[:128], cuts[128])
        first = list(decoded)
        long = tier.hold(scope, P[:256], cuts[256])
    finally:
        frame.decode_part = real  # type: ignore[assignment]
    assert first == ["block/0", "block/1", "ring", "logits"]
    assert decoded[len(first) :] == ["block/2", "block/3", "ring", "logits"]
    assert short is not None and long is not None
    assert short.parts[0][1] is long.parts[0][1] and short.parts[1][1] is long.parts[1][1]
    shared = {id(p) for _, p in short.parts} & {id(p) for _, p in long.parts}
    assert len(shared) == 2
    assert tier.resident_bytes == short.estimated_bytes + long.estimated_bytes - sum(
        len(p) for _, p in short.parts[:2]
    )


def test_a_promoted_durable_hit_keeps_no_slot_buffer_alive(settings, open_service):
    """Branch: holding the Snapshot a durable reader was installed as copies each part not
    held yet into buffers of its own (an intake's blocks are views of the slot's whole KV
    buffer), so the tier counts exactly what it keeps and no held array lies in a buffer
    of the slot's."""
    first = open_service(settings)
    ask(first, P)
    assert first.flush(30)
    first.close()
    svc = open_service(settings, resident_budget_bytes=0)
    scope, slot = svc.tenant("default").scope, svc.tenant("default").pool.slot(0)
    reader = CutReader.open(svc.vault, svc.vault.find(scope, scope.chain(P)), scope)
    installed = slot.restore(reader, prompt=P)
    assert reader.installed is installed
    svc.resident.set_budget(1 << 30)
    cut = svc.resident.hold(scope, P, installed)

    def span(a: mx.array) -> tuple[int, int]:
        start = np.asarray(a).ctypes.data
        return start, start + a.nbytes

    buffers = [span(b) for c in slot.state.cache for b in (c.keys, c.values)]
    assert any(lo <= span(a)[0] < hi for a in installed.arrays() for lo, hi in buffers)
    held = cut.snapshot.arrays()
    assert not any(lo <= span(a)[0] < hi for a in held for lo, hi in buffers)
    assert svc.resident.resident_bytes == sum(a.nbytes for a in held) == installed.nbytes
    assert physical_parts(cut.snapshot) == physical_parts(installed)


def test_a_durable_hit_is_promoted_and_stamped_once_its_request_is_served(settings, open_service):
    """Branch: a hit's background work follows the response. While a durable hit's
    request decodes its cut is not held (the slot's first write copies the caches the
    promotion holds, and the resident tier's own copy would race that one for memory)
    and its catalog row is not stamped (a write that ran beside the first token); once
    the request is served both are done, and the next ask is a resident hit."""
    first = open_service(settings)
    cold = ask(first, P)
    assert first.flush(30)
    first.close()
    svc = open_service(settings)
    at_p = Ask.of(svc.tenant("default").scope, P).bounded(at_most=len(P))
    cut = svc.vault.find(svc.tenant("default").scope, svc.tenant("default").scope.chain(P))
    assert cut is not None and cut.depth == len(P)

    def hits() -> int:
        with svc.vault.transaction() as s:
            return s.get(ManifestRow, cut.manifest_id.hex).hits

    steps = svc.steps(CompletionRequest(tokens=P, max_tokens=12, top_logprobs=3))
    assert next(steps) == "lookup"
    decoded = 0
    while True:
        assert svc.flush(30) and svc.resident.find(at_p) is None
        assert hits() == 0
        try:
            assert next(steps) == "decode"
        except StopIteration as done:
            durable = done.value
            break
        decoded += 1
    assert decoded == 12 and durable.tier == "durable"
    assert svc.flush(30) and svc.resident.find(at_p) is not None
    assert hits() == 1
    warm = ask(svc, P)
    assert warm.tier == "resident"
    assert answer(durable) == answer(warm) == answer(cold)


def physical_parts(snap) -> list[bytes]:
    return [np.asarray(a).tobytes() for a in snap.arrays()]


# -- a store that fails in the middle of a durable restore -------------------------------


class MidRestore(Wrapper):
    """Once armed, the third chunk read fails (an outage), stalls past the vault's
    timeout, or comes back with a flipped byte; other reads pass through."""

    def __init__(self, inner, mode: str) -> None:
        super().__init__(inner)
        self.mode, self.armed, self.reads = mode, False, 0

    async def get_into(self, key: str, out: memoryview) -> int:
        if not (self.armed and "chunks/" in key):
            return await self.inner.get_into(key, out)
        self.reads += 1
        third = self.reads == 3  # reads run concurrently: decide before awaiting
        if third and self.mode == "fail":
            raise StoreUnavailable("get", key, "connection reset mid-restore")
        if third and self.mode == "stall":
            await asyncio.sleep(30)
        n = await self.inner.get_into(key, out)
        if third and self.mode == "flip":
            out[n // 2] ^= 0x01
        return n


def vault_over(settings: Settings, wrap) -> Vault:
    """The vault Vault.open gives, its object store wrapped (a short I/O timeout)."""
    return Vault.open(settings, timeout_s=2.0, objects=wrap(settings.open_store()))


@contextmanager
def over_wrapped(settings: Settings, open_service, wrap):
    """P asked of a first service and its cuts published; then (a service whose vault's
    store is `wrap(the real store)`, that wrapper, the cold answer to P) for the body."""
    first = open_service(settings)
    cold = ask(first, P)
    assert first.flush(30)
    first.close()
    store: list = []
    vault = vault_over(settings, lambda inner: store.append(wrap(inner)) or store[0])
    try:
        svc = open_service(settings, vault=vault, resident_budget_bytes=0)
        yield svc, store[0], cold
        svc.close()
    finally:
        vault.close()


@pytest.mark.s3
@pytest.mark.parametrize("mode", ["fail", "stall", "flip"])
def test_a_bad_read_mid_restore_leaves_the_slot_untouched_and_recomputes(
    tmp_path, s3_config, open_service, mode
):
    """Branches: SeaweedFS fails, stalls or corrupts the third chunk of a durable restore
    through the intake, after other chunks have landed in the slot's shadow. The slot
    keeps exactly the state it had; the request recomputes the cold answer; an outage is
    not counted as a verification failure, a corrupt chunk is, and condemns the cut."""
    settings = Settings.load(
        data_dir=tmp_path / "vault", alignment=TINY_A, env={}, **s3_settings(s3_config)
    )
    with over_wrapped(settings, open_service, lambda s: MidRestore(s, mode)) as (svc, store, cold):
        slot = svc.tenant("default").pool.slot(0)
        ask(svc, Q)
        before, history = slot.state, slot.tokens
        store.armed = True
        request = Ask.of(svc.tenant("default").scope, P)
        assert svc.ladder.restore(request, lambda cut: slot.restore(cut, prompt=P)) is None
        assert store.reads >= 3
        assert slot.state is before and slot.tokens == history
        failures = svc.accounting.total("kvpack_verification_failures_total")
        condemned = svc.accounting.total("kvpack_condemned_cuts_total")
        # A broken chunk condemns every cut that uses it (the aligned cut at 256 too).
        assert (failures, condemned > 0) == ((1, True) if mode == "flip" else (0, False))
        assert (svc.durable.find(request) is None) == (mode == "flip")

        store.armed, store.reads = mode != "flip", 0
        again = ask(svc, P)
        assert (again.tier, answer(again)) == ("none", answer(cold))


class Watched(Wrapper):
    """Chunk reads that take `delay` seconds, with the first start signalled and the
    reads in flight counted."""

    def __init__(self, inner, delay: float = 0.0) -> None:
        super().__init__(inner)
        self.delay, self.started, self.flying = delay, threading.Event(), 0

    async def get_into(self, key: str, out: memoryview) -> int:
        if "chunks/" not in key:
            return await self.inner.get_into(key, out)
        self.started.set()
        self.flying += 1
        try:
            await asyncio.sleep(self.delay)
            return await self.inner.get_into(key, out)
        finally:
            self.flying -= 1


def reader_of(svc: Service, tokens: list[int]) -> CutReader:
    scope = svc.tenant("default").scope
    cut = svc.vault.find(scope, scope.chain(tokens))
    assert cut is not None and cut.depth == len(tokens)
    return CutReader.open(svc.vault, cut, scope)


def test_the_fetch_is_under_way_while_the_intake_allocates(settings, open_service):
    """A durable reader starts fetching before it asks the intake for its destinations
    (the call that allocates the shadow's buffers): the first chunk read has begun while
    that call is still running, and the restore then commits the whole prompt."""
    with over_wrapped(settings, open_service, Watched) as (svc, store, _):
        reader, slot = reader_of(svc, P), svc.tenant("default").pool.slot(0)
        intake = slot.intake(reader.layout)
        allocate = intake.destinations

        def destinations(parts):
            assert store.started.wait(10), "no chunk read began before the allocation"
            return allocate(parts)

        intake.destinations = destinations  # type: ignore[method-assign]
        reader.fill(intake)
        slot.restore(intake, prompt=P)
        assert list(slot.tokens) == P


def test_an_intake_that_cannot_allocate_stops_the_fetch(settings, open_service):
    """Branch: the intake's destinations raise while chunks are in flight. The error
    propagates from fill at once, every read in flight is cancelled (none is left running
    and no other starts), and the next reader restores normally."""
    with over_wrapped(settings, open_service, lambda s: Watched(s, 5.0)) as (svc, store, _):
        reader, slot = reader_of(svc, P), svc.tenant("default").pool.slot(0)
        intake = slot.intake(reader.layout)

        def refused(parts):
            assert store.started.wait(10)
            raise PlanesInvalid(None, "made to fail")

        intake.destinations = refused  # type: ignore[method-assign]
        started = time.monotonic()
        with pytest.raises(PlanesInvalid, match="made to fail"):
            reader.fill(intake)
        assert time.monotonic() - started < 2.0  # not after the 5 s reads
        deadline = time.monotonic() + 2.0
        while store.flying and time.monotonic() < deadline:
            time.sleep(0.01)
        assert store.flying == 0
        store.delay = 0.0
        slot.restore(reader_of(svc, P), prompt=P)
        assert list(slot.tokens) == P


class SlowManifests(Watched):
    """Manifest objects that take `manifest_delay` seconds to arrive, each arrival
    recorded (time.monotonic), besides Watched's chunk reads (their first start, too);
    across a network or not, as `remote` says."""

    def __init__(self, inner, *, remote: bool, manifest_delay: float = 0.3) -> None:
        super().__init__(inner)
        self.remote, self.manifest_delay = remote, manifest_delay
        self.manifests_at: list[float] = []
        self.chunk_started_at: list[float] = []

    async def get(self, key: str) -> bytes:
        data = await self.inner.get(key)
        if key.startswith("manifests/"):
            await asyncio.sleep(self.manifest_delay)
            self.manifests_at.append(time.monotonic())
        return data

    async def get_into(self, key: str, out: memoryview) -> int:
        if "chunks/" in key:
            self.chunk_started_at.append(time.monotonic())
        return await super().get_into(key, out)


def across_a_network(wrap):
    """`wrap`, its wrapper said to be remote (a reader then fetches chunks ahead of a
    manifest)."""

    def remote(inner):
        store = wrap(inner)
        store.remote = True
        return store

    return remote


@pytest.mark.parametrize("remote", [True, False], ids=["remote", "local"])
def test_a_remote_stores_chunks_are_fetched_while_the_manifest_is_on_its_way(
    settings, open_service, remote
):
    """A durable load from a remote store fetches the chunks its catalog row lists while
    the manifest object is still arriving (0.3 s late here): as many chunk reads as may
    be in flight have begun before the manifest came back. From a local one no chunk
    read begins before it. Either way the restore is the cold answer."""
    wrap = partial(SlowManifests, remote=remote)
    with over_wrapped(settings, open_service, wrap) as (svc, store, cold):
        store.chunk_started_at.clear()
        again = ask(svc, P)
        assert (again.tier, again.cached_tokens, answer(again)) == ("durable", len(P), answer(cold))
        assert len(store.manifests_at) == 1 and len(store.chunk_started_at) >= 2
        ahead = sum(t < store.manifests_at[0] for t in store.chunk_started_at)
        in_flight = svc.vault.chunks("default").max_concurrency
        assert ahead == (min(in_flight, len(store.chunk_started_at)) if remote else 0)


def test_a_manifest_that_lists_other_chunks_than_its_row_is_refused(settings, open_service):
    """Branch: the catalog's chunk list for a cut (what a remote store's reader fetches
    ahead) names the manifest's chunks in another order. The manifest verifies, but the
    reader refuses it before any chunk is opened: a verification failure, the cut
    condemned, the slot never half-written, and the next request answers the cold answer
    without it."""
    with over_wrapped(settings, open_service, across_a_network(Watched)) as (svc, _, cold):
        scope = svc.tenant("default").scope
        cut = svc.vault.find(scope, scope.chain(P))
        assert cut is not None and cut.depth == len(P)
        with svc.vault.transaction() as s:
            rows = s.scalars(
                select(ManifestChunkRow)
                .where(ManifestChunkRow.manifest == cut.manifest_id.hex)
                .order_by(ManifestChunkRow.ordinal)
            ).all()
            assert len(rows) >= 2
            rows[0].chunk, rows[1].chunk = rows[1].chunk, rows[0].chunk
        slot = svc.tenant("default").pool.slot(0)
        ask(svc, Q)
        before = slot.state
        request = Ask.of(scope, P)
        assert svc.ladder.restore(request, lambda c: slot.restore(c, prompt=P)) is None
        assert slot.state is before
        assert svc.accounting.total("kvpack_verification_failures_total") == 1
        assert svc.accounting.total("kvpack_condemned_cuts_total") >= 1
        again = ask(svc, P)  # from the aligned cut below it, which still serves
        assert again.cached_tokens < len(P) and answer(again) == answer(cold)
        assert svc.flush(30)


def test_a_reader_no_install_took_stops_its_fetch(settings, open_service):
    """Branch: the install refuses the cut before it asks for destinations (here: it
    raises at once), while a remote store's chunks are in flight. The ladder closes the
    reader: the chunk reads in flight (5 s each)
    are cancelled at once instead of holding their scratch buffers, and the next restore
    works."""
    slow = across_a_network(partial(Watched, delay=5.0))
    with over_wrapped(settings, open_service, slow) as (svc, store, _):
        request = Ask.of(svc.tenant("default").scope, P)

        def refuse(cut):
            assert store.started.wait(10), "no chunk read began"
            raise RestoreRefused("made to refuse")

        started = time.monotonic()
        assert svc.ladder.restore(request, refuse) is None
        while store.flying and time.monotonic() < started + 2.0:
            time.sleep(0.01)
        assert store.flying == 0 and time.monotonic() - started < 2.0


def test_the_mlx_cache_limit_setting_is_applied_when_a_service_opens(tmp_path, open_service):
    """Branch: mlx_cache_limit sets MLX's process-wide cache limit (restores then reuse
    freed buffers); unset, the service leaves MLX's own limit alone."""
    original = mx.set_cache_limit(1 << 20)
    try:
        open_service(Settings.load(data_dir=tmp_path / "a", alignment=TINY_A, env={}))
        assert mx.set_cache_limit(1 << 20) == 1 << 20  # left alone
        limited = Settings.load(
            data_dir=tmp_path / "b", alignment=TINY_A, env={"KVPACK_MLX_CACHE_LIMIT": "3MiB"}
        )
        open_service(limited)
        assert mx.set_cache_limit(original) == 3 << 20
    finally:
        mx.set_cache_limit(original)
