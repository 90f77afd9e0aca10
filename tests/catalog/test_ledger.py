"""The economics ledger: paired timings are measurements or nothing, and persist as such."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from catalog import ledger
from catalog.ids import IdentityDigest
from catalog.ledger import PairedTiming

ID = IdentityDigest(bytes(32 * [7]))
OTHER = IdentityDigest(bytes(32 * [8]))


@pytest.mark.parametrize(
    ("change", "what"),
    [
        ({"restore_seconds": 0.0}, "restore_seconds"),
        ({"prefill_seconds": float("nan")}, "prefill_seconds"),
        ({"prefill_seconds": float("inf")}, "prefill_seconds"),
        ({"restore_seconds": True}, "restore_seconds"),
        ({"depth": 0}, "depth"),
        ({"depth": 1.5}, "depth"),
        ({"identity": bytes(32)}, "identity"),
    ],
)
def test_paired_timing_rejects_unmeasurable_values(change, what):
    """Branch: a zero, non-finite or non-number leg, an empty cut or an identity that is
    not an IdentityDigest is not a measurement: ValueError naming the field."""
    args = dict(identity=ID, depth=256, tier="durable", restore_seconds=0.1, prefill_seconds=0.5)
    args.update(change)
    with pytest.raises(ValueError, match=what):
        PairedTiming(**args)


def test_timings_round_trip_per_identity_oldest_first(db_session):
    """insert_timing then timings(identities): exactly the given identities' entries, in
    measurement order, with every field as written."""
    t0 = datetime(2030, 1, 1, tzinfo=UTC)
    rows = [
        PairedTiming(ID, "durable", 512, 0.2, 4.0, t0.replace(second=2)),
        PairedTiming(OTHER, "resident", 256, 0.01, 2.0, t0.replace(second=1)),
        PairedTiming(ID, "resident", 256, 0.05, 2.5, t0.replace(second=0)),
    ]
    for row in rows:
        ledger.insert_timing(session=db_session, timing=row)
    assert ledger.timings(session=db_session, identities=[ID]) == [rows[2], rows[0]]
    assert ledger.timings(session=db_session, identities=[ID, OTHER]) == [rows[2], rows[1], rows[0]]
