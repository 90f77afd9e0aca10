"""The remote tier: a peer's cut, imported through quarantine (docs/architecture.md: step 3,
invariants 9 and 10).

A transport response never becomes an authority.
- find: ask each configured peer in order (skipping one in backoff) for its deepest cut
  of this identity and token chain deeper than ours — chain links only, the peer never
  sees token ids. The first offer is the candidate; its depth is the peer's unsigned
  claim, used only to rank it against local candidates. Nothing is kept.
- load: write the answer into quarantine (kvpack/remote/quarantine.py), then check it:
  - the signature is by a key the trust store holds (looked up by the key id in the
    signature, before anything signed is parsed); an unknown key is accepted only when
    the peer's bundle shows it endorsed by a trusted key (a rotation), and is then
    trusted from here on;
  - the statement decodes strictly and names the producer who signed it;
  - its identity is the one asked for, its alignment ours, its depth the claimed one and
    deeper than what we have, its chain digest the one our own tokens give at that
    depth; an exact (non-aligned) cut must have witnessed logits;
  - its generation is newer than the last accepted from that producer for that identity
    (a replayed or stale answer is refused);
  then fetch the planes into quarantine: exactly the signed size, each part's BLAKE3
  equal to its claim, and the parts decode (engine) to a cut of that identity and depth.
  Accept the generation (compare-and-set) and promote: publish into the local durable
  tier (chunks sealed under our keys; provenance "peer:<name>", the remote producer).
  Finally the cut is re-resolved through the local catalog and loaded like any durable
  cut: what is served is what our own store verified.
A refusal leaves the import in quarantine with its reason and counts an import refused;
the ladder counts the verification failure and falls through. A peer that is unreachable
or times out is skipped for backoff_s, so a dead peer costs one timeout, not one per miss.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import aiohttp

from catalog import trust
from catalog.signing import (
    EXPORT_DOMAIN,
    Bundle,
    BundleInvalid,
    SignatureInvalid,
    slot_key_id,
    verify,
)
from catalog.statement import Statement, StatementInvalid, decode
from engine.errors import RestoreRefused
from engine.format import decode as decode_planes
from engine.state import Planes
from kvpack.accounting.counters import Accounting
from kvpack.remote.peers import Peer
from kvpack.remote.quarantine import Quarantine
from kvpack.tiers.base import Ask, Candidate, Loaded, Refused, TierName
from kvpack.tiers.durable import CutReader
from kvpack.vault import Vault

log = logging.getLogger(__name__)
DEFAULT_MAX_IMPORT_BYTES = 4 << 30
DEFAULT_BACKOFF_S = 30.0


class PeerDown(Refused):
    """The peer did not answer in time or at all: skipped for a while (see backoff_s)."""


@dataclass(frozen=True)
class Offer:
    """A peer's answer to a find, unchecked: the candidate's handle."""

    peer: Peer
    body: bytes


class RemoteTier:
    name: TierName = "remote"

    def __init__(
        self,
        *,
        peers: Sequence[Peer],
        vault: Vault,
        quarantine: Quarantine,
        accounting: Accounting,
        timeout_s: float,
        backoff_s: float = DEFAULT_BACKOFF_S,
        max_import_bytes: int = DEFAULT_MAX_IMPORT_BYTES,
    ) -> None:
        self.peers = list(peers)
        self.vault = vault
        self.quarantine = quarantine
        self.accounting = accounting
        self.timeout_s = timeout_s
        self.backoff_s = backoff_s
        self.max_import_bytes = max_import_bytes
        self._session: aiohttp.ClientSession | None = None
        self._down_until: dict[str, float] = {}

    # -- the tier protocol ------------------------------------------------------------

    def find(self, ask: Ask) -> Candidate | None:
        for peer in self.peers:
            if time.monotonic() < self._down_until.get(peer.name, 0.0):
                continue  # a peer that just failed to answer would stall every miss
            try:
                status, body = self._call(peer, "POST", "/v1/peer/find", json=_find_request(ask))
            except Refused as e:
                log.warning("remote find at %s failed: %s", peer.name, e.reason)
                continue
            if status == 404:
                continue
            depth = _claimed_depth(body) if status == 200 else None
            if depth is None or depth <= ask.deeper_than:
                log.warning("peer %s answered a find with HTTP %d and no usable offer", peer.name,
                            status)  # fmt: skip
                continue
            return Candidate(self.name, depth, Offer(peer, body))
        return None

    def load(self, candidate: Candidate, ask: Ask) -> Loaded:
        offer: Offer = candidate.handle
        peer, q, ns = offer.peer, self.quarantine, ask.scope.namespace
        import_id = q.open(peer=peer.name, identity=ask.scope.identity)
        try:
            q.put(import_id, "statement", offer.body)
            statement = self._check_statement(peer, offer.body, ask, candidate.depth)
            q.note(import_id, producer=statement.producer, generation=statement.generation,
                   depth=statement.depth)  # fmt: skip
            data = self._fetch_planes(peer, statement)
            q.put(import_id, "planes", data)
            planes = _check_planes(statement, data, ask)
            self._accept(statement)
            manifest = self.vault.publish(
                ask.scope,
                ask.tokens[: statement.depth],
                layout=planes.layout,
                parts=planes.parts,
                logits_witnessed=statement.logits_witnessed,
                producer=statement.producer,
                provenance=f"peer:{peer.name}",
            )
        except Refused as e:
            if isinstance(e, PeerDown):
                self._down_until[peer.name] = time.monotonic() + self.backoff_s
            q.refuse(import_id, e.reason)
            self.accounting.count_remote_import(outcome="refused", namespace=ns)
            raise
        q.promoted(import_id, manifest.id.hex)
        self.accounting.count_remote_import(outcome="promoted", namespace=ns)
        log.info("imported %s (depth %d) from %s", manifest.id, manifest.depth, peer.name)
        return self._resolve_locally(ask, manifest.depth)

    def served(self, candidate: Candidate, ask: Ask) -> None:
        return None  # the promoted cut is new in the catalog: recent enough for GC

    def refused(self, candidate: Candidate, error: BaseException) -> None:
        return None  # quarantine already holds the refusal and its reason

    def close(self) -> None:
        if self._session is not None:
            self.vault.run(self._session.close(), self.timeout_s)
            self._session = None

    # -- one import ---------------------------------------------------------------------

    def _resolve_locally(self, ask: Ask, depth: int) -> Loaded:
        """The promoted cut, found and loaded through our own catalog and store."""
        cut = self.vault.find(ask.scope, ask.chain, deeper_than=depth - 1, at_most=depth)
        if cut is None:
            raise Refused(f"the promoted cut at depth {depth} is not in the local catalog")
        reader = CutReader.open(self.vault, cut, ask.scope)  # read as a durable hit is
        return Loaded(reader, manifest_bytes=reader.manifest.bytes)

    def _check_statement(self, peer: Peer, body: bytes, ask: Ask, claimed: int) -> Statement:
        try:
            doc = json.loads(body)
            raw = base64.b64decode(doc["statement"], validate=True)
            slot = base64.b64decode(doc["signature"], validate=True)
        except (ValueError, TypeError, KeyError, binascii.Error) as e:
            raise Refused(f"malformed answer: {e}") from None
        producer = self._verify_signature(peer, raw, slot)  # before parsing what it signs
        try:
            s = decode(raw)
        except StatementInvalid as e:
            raise Refused(str(e)) from None
        if s.producer != producer:
            raise Refused(f"statement names producer {s.producer!r}, signed by {producer!r}")
        if s.identity != ask.scope.identity:
            raise Refused(
                f"statement is for identity {s.identity.hex[:16]}, "
                f"asked for {ask.scope.identity.hex[:16]}"
            )
        if s.alignment != ask.chain.alignment:
            raise Refused(f"alignment {s.alignment} is not ours ({ask.chain.alignment})")
        links = dict(ask.chain.links)
        if s.depth != claimed:
            raise Refused(f"statement depth {s.depth} is not the claimed {claimed}")
        if s.depth <= ask.deeper_than or s.depth not in links:
            raise Refused(f"depth {s.depth} is not a link deeper than {ask.deeper_than}")
        if links[s.depth] != s.chain:
            raise Refused(f"chain digest at depth {s.depth} does not match the asked tokens")
        if not s.aligned and not s.logits_witnessed:
            raise Refused("an exact cut without witnessed logits cannot serve")
        if s.size > self.max_import_bytes:
            raise Refused(f"{s.size} bytes is over the import limit {self.max_import_bytes}")
        last = self.vault.read(
            lambda session: trust.accepted_generation(
                session=session, producer=s.producer, identity=s.identity
            )
        )
        if last is not None and s.generation <= last:
            raise Refused(f"replayed or stale: generation {s.generation} <= accepted {last}")
        return s

    def _verify_signature(self, peer: Peer, raw: bytes, slot: bytes) -> str:
        """The producer whose trusted key signed `raw`; Refused otherwise."""
        kid = slot_key_id(slot)
        if kid is None:
            raise Refused(f"signature slot is {len(slot)} bytes")
        owner = self.vault.read(lambda s: trust.key_owner(session=s, key_id=kid))
        if owner is None:
            owner = self._endorsed(peer, kid)
        producer, public = owner
        try:
            verify({kid: public}, EXPORT_DOMAIN, raw, slot)
        except SignatureInvalid as e:
            raise Refused(f"producer {producer!r}: {e}") from None
        return producer

    def _endorsed(self, peer: Peer, kid: str) -> tuple[str, bytes]:
        """(producer, key) for a key the trust store does not hold: accepted only when the
        peer's bundle shows it endorsed by a trusted key of its producer (a rotation),
        and then trusted from here on."""
        status, body = self._call(peer, "GET", "/v1/peer/keys")
        untrusted = Refused(f"signed by key {kid}, which is not trusted")
        if status != 200:
            raise untrusted
        try:
            bundle = Bundle.from_json(body)
        except BundleInvalid as e:
            raise Refused(f"signed by untrusted key {kid}; peer's bundle: {e}") from None
        with self.vault.transaction() as session:
            trusted = trust.trusted_keys(session=session, producer=bundle.producer)
            known = trust.known_key_ids(session=session, producer=bundle.producer)
            new = [k for k in bundle.endorsed_from(trusted) if k.id not in known]
            if kid not in {k.id for k in new}:
                raise untrusted
            trust.trust_keys(
                session=session,
                producer=bundle.producer,
                keys=[(k.id, k.public, k.endorsed_by) for k in new],
                now=datetime.now(UTC),
            )
        log.info("trusting %s keys %s (endorsed)", bundle.producer, [k.id for k in new])
        return bundle.producer, next(k.public for k in new if k.id == kid)

    def _fetch_planes(self, peer: Peer, s: Statement) -> bytes:
        status, data = self._call(peer, "GET", f"/v1/peer/packs/{s.manifest.hex}/planes",
                                  limit=s.size + 1)  # fmt: skip
        if status != 200:
            raise Refused(f"peer answered the planes fetch with HTTP {status}")
        if len(data) < s.size:
            raise Refused(f"truncated planes: received {len(data)} of {s.size} bytes")
        if len(data) > s.size:
            raise Refused(f"planes body is longer than the signed {s.size} bytes")
        return data

    def _accept(self, s: Statement) -> None:
        with self.vault.transaction() as session:
            accepted = trust.accept_generation(
                session=session,
                producer=s.producer,
                identity=s.identity,
                generation=s.generation,
                now=datetime.now(UTC),
            )
        if not accepted:
            raise Refused(f"replayed or stale: generation {s.generation} lost to a newer one")

    # -- transport ----------------------------------------------------------------------

    def _call(
        self, peer: Peer, method: str, path: str, *, json: Any = None, limit: int = 1 << 20
    ) -> tuple[int, bytes]:
        """(status, body up to `limit` bytes); PeerDown when the peer is unreachable or
        slow (and it is skipped for a while), Refused on a truncated body."""
        try:
            return self.vault.run(
                self._request(peer, method, path, json, limit), self.timeout_s + 1
            )
        except TimeoutError:
            self._down_until[peer.name] = time.monotonic() + self.backoff_s
            raise PeerDown(f"peer timed out after {self.timeout_s:g}s on {method} {path}") from None
        except aiohttp.ClientPayloadError as e:
            raise Refused(f"truncated body on {method} {path}: {e}") from None
        except aiohttp.ClientError as e:
            self._down_until[peer.name] = time.monotonic() + self.backoff_s
            raise PeerDown(f"peer unreachable on {method} {path}: {e}") from None

    async def _request(
        self, peer: Peer, method: str, path: str, body: Any, limit: int
    ) -> tuple[int, bytes]:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout_s)
            )
        headers = {"Authorization": f"Bearer {peer.api_key}"}
        async with self._session.request(method, peer.url + path, json=body,
                                         headers=headers) as response:  # fmt: skip
            data = bytearray()
            while len(data) < limit:  # read() may return less than asked before EOF
                chunk = await response.content.read(limit - len(data))
                if not chunk:
                    break
                data += chunk
            return response.status, bytes(data)


def _find_request(ask: Ask) -> dict[str, Any]:
    return {
        "identity": ask.scope.identity.hex,
        "alignment": ask.chain.alignment,
        "depth": ask.chain.depth,
        "links": [[d, h.hex] for d, h in ask.chain.links],
        "min_depth": ask.deeper_than,
    }


def _claimed_depth(body: bytes) -> int | None:
    """The depth a peer's answer claims (unsigned: only ranks the offer; load checks it)."""
    try:
        depth = json.loads(body).get("depth")
    except (ValueError, AttributeError):
        return None
    return depth if isinstance(depth, int) and not isinstance(depth, bool) else None


def _check_planes(s: Statement, data: bytes, ask: Ask) -> Planes:
    view, parts, offset = memoryview(data), [], 0
    for i, claim in enumerate(s.parts):
        part = view[offset : offset + claim.size]
        if not claim.matches(part):
            raise Refused(f"part {i} ({claim.role}) does not match its signed digest")
        parts.append((claim.role, part))
        offset += claim.size
    planes = Planes(layout=dict(s.layout), parts=tuple(parts))
    try:
        cut = decode_planes(planes)
    except RestoreRefused as e:
        raise Refused(f"planes do not decode: {e}") from None
    if cut.identity != ask.scope.identity.raw or cut.depth != s.depth:
        raise Refused("planes describe another identity or depth than the statement")
    return planes
