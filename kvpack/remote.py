"""The remote tier: import a peer's cut through quarantine (DESIGN flow step 2, inv. 9, 10).

A transport response never becomes an authority. For each configured peer, in order:
1. ask for the deepest cut of this identity and token chain (chain links only; the
   peer never sees token ids). No cut: nothing is kept.
2. write the answer into quarantine (kvpack/quarantine.py), then check it:
   - the statement decodes strictly (catalog/statement.py);
   - its signature is by a key the trust store holds for the producer it names;
     an unknown key is accepted only when the peer's bundle shows it endorsed by a
     trusted key (rotation), and is then trusted from here on;
   - its identity is the one asked for, its alignment ours, its depth deeper than
     what we already have, its chain digest the one our own tokens give at that
     depth; an exact (non-aligned) cut must have witnessed logits;
   - its generation is newer than the last accepted from that producer for that
     identity (a replayed or stale answer is refused);
3. fetch the planes into quarantine: exactly the signed size (a short or long body
   is refused), each plane's BLAKE3 equal to its claim, and the planes decode to a
   snapshot of that identity and depth;
4. accept the generation (compare-and-set), then promote: publish into the local
   durable tier (chunks sealed under our keys, put-if-absent; catalog row with
   provenance "peer:<name>" and the remote producer). The ladder then re-resolves
   the request through the local catalog.
A refusal leaves the import in quarantine with its reason, counts a remote
verification failure, and the request falls through to recompute. A peer that is
unreachable or times out is refused the same way and then skipped for backoff_s, so
a dead peer costs one timeout, not one per miss. No failure here ever fails the
request (a local store or catalog outage while importing is logged and skipped).
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
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from cas.errors import StoreUnavailable
from catalog import trust
from catalog.chain import TokenChain, token_chain
from catalog.signing import (
    EXPORT_DOMAIN,
    Bundle,
    BundleInvalid,
    SignatureInvalid,
    slot_key_id,
    verify,
)
from catalog.statement import Statement, StatementInvalid, decode
from engine import planes
from engine.errors import RestoreRefused
from engine.identity import Identity
from kvpack.accounting import Accounting
from kvpack.durable import DurableTier
from kvpack.peers import Peer
from kvpack.quarantine import Quarantine

log = logging.getLogger(__name__)
DEFAULT_MAX_IMPORT_BYTES = 4 << 30
DEFAULT_BACKOFF_S = 30.0
LOCAL_OUTAGES = (StoreUnavailable, SQLAlchemyError, OSError)


class Refused(Exception):
    """An import failed a check; `reason` is what the quarantine row records."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class PeerDown(Refused):
    """The peer did not answer in time or at all: skipped for a while (see backoff_s)."""


@dataclass(frozen=True)
class _Ask:
    identity: Identity
    tokens: Sequence[int]
    chain: TokenChain
    min_depth: int


class PeerTier:
    """RemoteTier over the configured peers (kvpack/ladder.py)."""

    def __init__(
        self,
        *,
        peers: Sequence[Peer],
        durable: DurableTier,
        quarantine: Quarantine,
        accounting: Accounting,
        timeout_s: float,
        backoff_s: float = DEFAULT_BACKOFF_S,
        max_import_bytes: int = DEFAULT_MAX_IMPORT_BYTES,
    ) -> None:
        self.peers = list(peers)
        self.durable = durable
        self.quarantine = quarantine
        self.accounting = accounting
        self.timeout_s = timeout_s
        self.backoff_s = backoff_s
        self.max_import_bytes = max_import_bytes
        self._session: aiohttp.ClientSession | None = None
        self._down_until: dict[str, float] = {}

    def pull(
        self, *, identity: Identity, tokens: Sequence[int], alignment: int, min_depth: int
    ) -> bool:
        ask = _Ask(identity, tokens, token_chain(tokens, alignment=alignment), min_depth)
        for peer in self.peers:
            if time.monotonic() < self._down_until.get(peer.name, 0.0):
                continue  # a peer that just failed to answer would stall every miss
            try:
                if self._import(peer, ask):
                    return True
            except LOCAL_OUTAGES as e:
                log.warning("remote import from %s skipped (local outage): %s", peer.name, e)
        return False

    def close(self) -> None:
        if self._session is not None:
            self.durable.io.run(self._session.close(), self.timeout_s)
            self._session = None

    # -- one import ---------------------------------------------------------------------

    def _import(self, peer: Peer, ask: _Ask) -> bool:
        q, ns = self.quarantine, ask.identity.components["namespace"]
        import_id = q.open(peer=peer.name, identity=ask.identity.digest)
        try:
            status, body = self._call(peer, "POST", "/v1/peer/find", json=_find_request(ask))
            if status == 404:
                q.discard(import_id)
                return False
            if status != 200:
                raise Refused(f"peer answered the find with HTTP {status}")
            q.put(import_id, "statement", body)
            statement = self._check_statement(peer, body, ask)
            q.note(import_id, producer=statement.producer, generation=statement.generation,
                   depth=statement.depth)  # fmt: skip
            data = self._fetch_planes(peer, statement)
            q.put(import_id, "planes", data)
            parts = _check_planes(statement, data, ask.identity)
            self._accept(statement)
            manifest = self.durable.publish(
                namespace=ns,
                identity=ask.identity,
                tokens=ask.tokens[: statement.depth],
                layout=dict(statement.layout),
                parts=parts,
                logits_witnessed=statement.logits_witnessed,
                producer=statement.producer,
                provenance=f"peer:{peer.name}",
            )
        except Refused as e:
            if isinstance(e, PeerDown):
                self._down_until[peer.name] = time.monotonic() + self.backoff_s
            q.refuse(import_id, e.reason)
            self.accounting.record_verification_failure(tier="remote", namespace=ns)
            self.accounting.record_remote_import(outcome="refused", namespace=ns)
            return False
        q.promoted(import_id, manifest.id)
        self.accounting.record_remote_import(outcome="promoted", namespace=ns)
        log.info("imported %s (depth %d) from %s", manifest.id, manifest.depth, peer.name)
        return True

    def _check_statement(self, peer: Peer, body: bytes, ask: _Ask) -> Statement:
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
        if s.identity != ask.identity.digest:
            raise Refused(
                f"statement is for identity {s.identity.hex()[:16]}, "
                f"asked for {ask.identity.hex[:16]}"
            )
        if s.alignment != ask.chain.alignment:
            raise Refused(f"alignment {s.alignment} is not ours ({ask.chain.alignment})")
        links = dict(ask.chain.links)
        if s.depth <= ask.min_depth or s.depth not in links:
            raise Refused(f"depth {s.depth} is not a link deeper than {ask.min_depth}")
        if links[s.depth] != s.chain:
            raise Refused(f"chain digest at depth {s.depth} does not match the asked tokens")
        if not s.aligned and not s.logits_witnessed:
            raise Refused("an exact cut without witnessed logits cannot serve")
        if s.size > self.max_import_bytes:
            raise Refused(f"{s.size} bytes is over the import limit {self.max_import_bytes}")
        with Session(self.durable.db) as session:
            last = trust.accepted_generation(
                session=session, producer=s.producer, identity=s.identity
            )
        if last is not None and s.generation <= last:
            raise Refused(f"replayed or stale: generation {s.generation} <= accepted {last}")
        return s

    def _verify_signature(self, peer: Peer, raw: bytes, slot: bytes) -> str:
        """The producer whose trusted key signed `raw`; Refused otherwise."""
        kid = slot_key_id(slot)
        if kid is None:
            raise Refused(f"signature slot is {len(slot)} bytes")
        with Session(self.durable.db) as session:
            owner = trust.key_owner(session=session, key_id=kid)
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
        with Session(self.durable.db) as session, session.begin():
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
        status, data = self._call(peer, "GET", f"/v1/peer/packs/{s.manifest}/planes",
                                  limit=s.size + 1)  # fmt: skip
        if status != 200:
            raise Refused(f"peer answered the planes fetch with HTTP {status}")
        if len(data) < s.size:
            raise Refused(f"truncated planes: received {len(data)} of {s.size} bytes")
        if len(data) > s.size:
            raise Refused(f"planes body is longer than the signed {s.size} bytes")
        return data

    def _accept(self, s: Statement) -> None:
        with Session(self.durable.db) as session, session.begin():
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
        """(status, body up to `limit` bytes); Refused when the peer is unreachable or slow."""
        try:
            return self.durable.io.run(
                self._request(peer, method, path, json, limit), self.timeout_s + 1
            )
        except TimeoutError:
            raise PeerDown(f"peer timed out after {self.timeout_s:g}s on {method} {path}") from None
        except aiohttp.ClientPayloadError as e:
            raise Refused(f"truncated body on {method} {path}: {e}") from None
        except aiohttp.ClientError as e:
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


def _find_request(ask: _Ask) -> dict[str, Any]:
    return {
        "identity": ask.identity.hex,
        "alignment": ask.chain.alignment,
        "depth": ask.chain.depth,
        "links": [[d, h.hex()] for d, h in ask.chain.links],
        "min_depth": ask.min_depth,
    }


def _check_planes(s: Statement, data: bytes, identity: Identity) -> list[tuple[str, memoryview]]:
    view, parts, offset = memoryview(data), [], 0
    for i, claim in enumerate(s.planes):
        part = view[offset : offset + claim.size]
        if not claim.matches(part):
            raise Refused(f"plane {i} ({claim.role}) does not match its signed digest")
        parts.append((claim.role, part))
        offset += claim.size
    try:
        snap = planes.decode(dict(s.layout), parts)
    except RestoreRefused as e:
        raise Refused(f"planes do not decode: {e}") from None
    if snap.identity != identity.digest or snap.depth != s.depth:
        raise Refused("planes describe another identity or depth than the statement")
    return parts
