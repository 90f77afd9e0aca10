"""`kvpack vault`: see what the vault holds and keep it, by hand or from scripts.

    kvpack vault stats [--json]
    kvpack vault ls [--namespace NS] [--identity ID] [--model NAME] [--limit N] [--json]
    kvpack vault verify [--read-data] [--sample PERCENT] [--repair] [--json]
    kvpack vault gc [--budget SIZE] [--grace DURATION] [--dry-run] [--json]
    kvpack vault forget (--identity ID | --model NAME | --namespace NS) [--dry-run] [--json]
    kvpack vault quota set NAMESPACE SIZE | quota clear NAMESPACE | quota list [--json]
    kvpack vault condemned [--limit N] [--json]

Exit status: 0 on success, 1 when the command found a problem (verify: a broken object;
gc: another instance holds the collector's lease; forget: no cut matched), 2 on bad
usage. Sizes take units (50GiB, 500MB), durations 30s, 15m, 7d. Verify, gc and forget
show a progress bar on a terminal (stderr) and stay quiet when piped. The vault is found
as `kvpack serve` finds it (the storage flags, the environment, --config).

- stats: footprint (distinct chunk bytes the cuts reference), stored and pending bytes,
  cuts, chunks, the dedup ratio (cut bytes / footprint), hits; per identity (with its
  model) and per tenant, with the budget (store_budget, else the one the last GC pass
  applied) and each quota's use.
- verify: catalog/verify.py; names each broken object and the cuts it breaks. --repair
  condemns them (the next request recomputes and republishes each).
- gc: one pass of the maintainer (kvpack/maintainer.py) under its lease; --budget and
  --grace default to the store_budget and gc_grace_s settings.
- forget: catalog/forget.py; the cuts are unreachable at once, GC reclaims their bytes.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from kvpack.commands import common
from kvpack.commands.common import UsageError
from kvpack.units import format_duration, format_size, parse_duration, parse_size

if TYPE_CHECKING:
    from kvpack.config import Settings
    from kvpack.vault import Vault

RAW = argparse.RawDescriptionHelpFormatter
PROG = "kvpack vault"


def register(sub: common.Subparsers) -> None:
    p = sub.add_parser(
        "vault",
        help="what the vault holds; verify, gc, forget, quotas",
        description=__doc__,
        formatter_class=RAW,
    )
    actions = p.add_subparsers(dest="action", required=True)
    storage = common.storage_parser()
    out = argparse.ArgumentParser(add_help=False)
    out.add_argument("--json", action="store_true", help="one JSON document on stdout")
    both = [storage, out]
    actions.add_parser("stats", parents=both, help="footprint, dedup, hits, per identity/tenant")
    ls = actions.add_parser("ls", parents=both, help="cuts (--namespace filters by tenant)")
    ls.add_argument("--identity", help="an identity digest or a hex prefix of one")
    ls.add_argument("--model", help="the model name the identity was recorded with")
    ls.add_argument("--limit", type=common.positive_int, metavar="N", help="at most N cuts")
    verify = actions.add_parser("verify", parents=both, help="check every cut, like restic check")
    verify.add_argument(
        "--read-data", action="store_true", help="open and re-hash every referenced chunk too"
    )
    verify.add_argument(
        "--sample",
        type=_percent,
        metavar="PERCENT",
        help="read only PERCENT%% of the chunks (implies --read-data)",
    )
    verify.add_argument("--repair", action="store_true", help="condemn the cuts found broken")
    gc = actions.add_parser("gc", parents=both, help="one GC pass under the collector's lease")
    gc.add_argument("--budget", type=_size, metavar="SIZE", help="default: store_budget")
    gc.add_argument("--grace", type=_duration, metavar="DURATION", help="default: gc_grace_s")
    gc.add_argument("--dry-run", action="store_true", help="say what would go, delete nothing")
    forget = actions.add_parser(
        "forget", parents=both, help="make an identity's, model's or tenant's cuts unreachable"
    )
    forget.add_argument("--identity", help="an identity digest or a hex prefix of one")
    forget.add_argument("--model", help="every identity recorded with this model name")
    forget.add_argument("--dry-run", action="store_true", help="count, delete nothing")
    quota = actions.add_parser("quota", help="per-tenant byte quotas (stored in the catalog)")
    qa = quota.add_subparsers(dest="quota_action", required=True)
    qset = qa.add_parser("set", parents=both, help="set a tenant's quota")
    qset.add_argument("tenant", metavar="NAMESPACE")
    qset.add_argument("size", type=_size, metavar="SIZE")
    qclear = qa.add_parser("clear", parents=both, help="remove a tenant's quota")
    qclear.add_argument("tenant", metavar="NAMESPACE")
    qa.add_parser("list", parents=both, help="every quota and its use")
    condemned = actions.add_parser(
        "condemned", parents=both, help="cuts condemned after failing verification, and why"
    )
    condemned.add_argument("--limit", type=common.positive_int, default=50, metavar="N")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return common.run_action(PROG, ACTIONS, args)


# -- argument types --------------------------------------------------------------------


def _typed(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def check(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return check


_size = _typed(parse_size)
_duration = _typed(parse_duration)


def _percent(text: str) -> float:
    try:
        value = float(text.rstrip("%"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a percentage: {text!r}") from None
    if not 0 < value <= 100:
        raise argparse.ArgumentTypeError(f"a sample is a percentage in (0, 100], got {text}")
    return value / 100


# -- helpers ---------------------------------------------------------------------------


@contextmanager
def _vault(args: argparse.Namespace) -> Iterator[tuple[Settings, Vault]]:
    settings = common.settings(args)
    with common.vault(settings) as vault:
        yield settings, vault


@contextmanager
def progress(total: int, what: str) -> Iterator[Callable[[int], None]]:
    """A progress bar on stderr when it is a terminal; nothing when piped."""
    from tqdm import tqdm  # type: ignore[import-untyped]  # no stubs

    bar = tqdm(
        total=total,
        desc=what,
        unit="obj",
        file=sys.stderr,
        leave=False,
        disable=not sys.stderr.isatty(),
    )
    try:
        yield bar.update
    finally:
        bar.close()


def _emit(args: argparse.Namespace, doc: Any, lines: Callable[[], list[str]]) -> None:
    if args.json:
        print(json.dumps(doc, indent=2, default=str))
    else:
        print("\n".join(lines()))


def _when(t: datetime | None) -> str:
    if t is None:
        return "never"
    age = (datetime.now(UTC) - t).total_seconds()
    return f"{t:%Y-%m-%d %H:%M} ({format_duration(max(age, 0))} ago)"


def _ratio(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}x"


def _use(used: int, limit: int | None) -> str:
    return "-" if not limit else f"{100 * used / limit:.1f}%"


# -- actions ---------------------------------------------------------------------------


def _stats(args: argparse.Namespace) -> int:
    from catalog import runs

    with _vault(args) as (settings, vault):
        st = vault.stats()
        last_gc, last_verify = vault.read(
            lambda s: (runs.last(session=s, kind="gc"), runs.last(session=s, kind="verify"))
        )
    budget = settings.store_budget
    if budget is None and last_gc is not None:  # the budget the fleet's collector applies
        budget = (last_gc.details or {}).get("budget_bytes")
    t = st.total
    doc = {
        **st.to_json(),
        "budget_bytes": budget,
        "budget_use": t.footprint / budget if budget else None,
        "last_gc": _run_json(last_gc),
        "last_verify": _run_json(last_verify),
    }

    def lines() -> list[str]:
        out = [
            f"footprint   {format_size(t.footprint)} in {t.chunks:,} chunks"
            f" (budget {format_size(budget)}, {_use(t.footprint, budget)} used)",
            f"cuts        {t.cuts:,} cuts, {format_size(t.cut_bytes)} of cut bytes: dedup "
            f"{_ratio(t.dedup_ratio)}",
            f"stored      {format_size(st.stored_bytes)} sealed in {st.chunk_rows:,} chunks; "
            f"pending reclaim {format_size(st.pending_bytes)} in {st.pending_chunks:,}",
            f"hits        {t.hits:,} durable/remote hits, last {_when(t.last_hit)}",
            f"last gc     {_run_line(last_gc)}",
            f"last verify {_run_line(last_verify)}",
            "",
            f"{'identity':<14} {'model':<20} {'tenant':<12} {'cuts':>6} {'cut bytes':>11} "
            f"{'footprint':>11} {'dedup':>7} {'hits':>6}  last hit",
        ]
        for u in st.identities:
            out.append(
                f"{u.identity[:12]:<14} {_cut(u.model or '-', 20):<20} "
                f"{_cut(u.namespace or '-', 12):<12} {u.cuts:>6,} {format_size(u.cut_bytes):>11} "
                f"{format_size(u.footprint):>11} {_ratio(u.dedup_ratio):>7} {u.hits:>6,}  "
                f"{_when(u.last_hit)}"
            )
        out += [
            "",
            f"{'tenant':<16} {'cuts':>6} {'footprint':>11} {'quota':>11} {'used':>7} {'hits':>6}",
        ]
        for ten in st.tenants:
            out.append(
                f"{_cut(ten.namespace, 16):<16} {ten.cuts:>6,} {format_size(ten.footprint):>11} "
                f"{format_size(ten.quota):>11} {_use(ten.footprint, ten.quota):>7} "
                f"{ten.hits:>6,}"
            )
        return out

    _emit(args, doc, lines)
    return 0


def _ls(args: argparse.Namespace) -> int:
    from catalog.stats import list_cuts

    with _vault(args) as (_, vault):
        cuts = vault.read(
            lambda s: list_cuts(
                session=s,
                namespace=args.namespace,
                identity=args.identity,
                model=args.model,
                limit=args.limit,
            )
        )

    def lines() -> list[str]:
        out = [
            f"{'identity':<14} {'model':<16} {'tenant':<12} {'depth':>7} {'bytes':>11} "
            f"{'logits':<6} {'provenance':<12} {'created':<16} {'hits':>5}  last hit"
        ]
        for c in cuts:
            out.append(
                f"{c.identity[:12]:<14} {_cut(c.model or '-', 16):<16} "
                f"{_cut(c.namespace or '-', 12):<12} {c.depth:>7,} {format_size(c.bytes):>11} "
                f"{'yes' if c.logits_witnessed else 'no':<6} {_cut(c.provenance, 12):<12} "
                f"{c.created_at:%Y-%m-%d %H:%M} {c.hits:>5,}  {_when(c.last_hit_at)}"
            )
        return out

    _emit(args, [c.to_json() for c in cuts], lines)
    return 0


def _verify(args: argparse.Namespace) -> int:
    from catalog.verify import VerifyReport, plan_size
    from kvpack.maintainer import Maintainer

    read_data = args.read_data or args.sample is not None
    sample = args.sample or 1.0
    with _vault(args) as (_, vault):
        total = vault.read(lambda s: plan_size(session=s, read_data=read_data, sample=sample))
        with progress(total, "verify") as step:
            done = Maintainer(vault=vault).verify_once(
                read_data=read_data, sample=sample, repair=args.repair, progress=step
            )
    if done.outcome == "skipped":
        print(f"{PROG} verify: another verify holds the lease ({done.holder})", file=sys.stderr)
        return 1
    report = done.report
    assert isinstance(report, VerifyReport)

    def lines() -> list[str]:
        what = (
            "every byte re-hashed"
            if report.read_data and report.sample == 1
            else f"{report.sample:.0%} of chunks re-hashed"
            if report.read_data
            else "sizes only; --read-data re-hashes every byte"
        )
        out = [
            f"checked {report.manifests:,} cuts and {report.chunks:,} chunks ({what}; "
            f"{format_size(report.bytes_read)} read)"
        ]
        for p in report.problems:
            out.append(f"BROKEN {p.object_key}: {p.kind}: {p.detail}")
            for c in p.cuts:
                out.append(
                    f"    breaks cut {c.manifest_id} (identity {c.identity[:12]}, "
                    f"depth {c.depth:,})"
                )
        if report.ok:
            out.append("no problems found")
        else:
            out.append(
                f"{len(report.problems)} broken object(s), {len(report.broken_cuts)} "
                f"cut(s) affected"
            )
            out.append(
                f"condemned {len(report.repaired)} cut(s): the next request for each "
                "recomputes and republishes it"
                if args.repair
                else "run `kvpack vault verify --repair` to condemn them"
            )
        return out

    _emit(args, report.to_json(), lines)
    return 0 if report.ok else 1


def _gc(args: argparse.Namespace) -> int:
    from catalog.gc import GcReport
    from catalog.gcplan import plan
    from kvpack.maintainer import Maintainer

    with _vault(args) as (settings, vault):
        budget = args.budget if args.budget is not None else settings.store_budget
        grace = timedelta(seconds=args.grace if args.grace is not None else settings.gc_grace_s)
        if args.dry_run:
            cutoff = datetime.now(UTC) - grace
            got = vault.read(lambda s: plan(session=s, budget_bytes=budget, cutoff=cutoff))
            doc = got.to_json()
            _emit(
                args,
                doc,
                lambda: [
                    f"would evict {len(got.evict):,} cut(s) ({_by(got.evict_by())}), freeing "
                    f"{format_size(got.freed_bytes)}: footprint {format_size(got.footprint_before)}"
                    f" -> {format_size(got.footprint_after)} (budget {format_size(budget)})",
                    f"would delete {got.reclaimable_chunks:,} unreferenced chunk(s) older than "
                    f"{format_duration(grace.total_seconds())} "
                    f"({format_size(got.reclaimable_bytes)})",
                ],
            )
            return 0
        maintainer = Maintainer(
            vault=vault,
            budget_bytes=budget,
            grace_s=grace.total_seconds(),
            quarantine_retention_s=settings.quarantine_retention_s,
        )
        done = maintainer.collect_once(orphans=True)
    if done.outcome == "skipped":
        print(
            f"{PROG} gc: another collector holds the lease ({done.holder}); try again "
            "after its pass",
            file=sys.stderr,
        )
        return 1
    report = done.report
    assert isinstance(report, GcReport)
    doc = {**report.to_json(), "quarantine_dropped": done.quarantine_dropped}
    _emit(
        args,
        doc,
        lambda: [
            f"evicted {len(report.evicted):,} cut(s) ({format_size(report.freed_bytes)} freed): "
            f"footprint {format_size(report.footprint_before)} -> "
            f"{format_size(report.footprint_after)} (budget {format_size(budget)})",
            f"deleted {len(report.deleted_chunks):,} chunk(s) unreferenced for "
            f"{format_duration(grace.total_seconds())}, {len(report.orphan_manifests):,} orphaned "
            f"manifest object(s), {len(report.orphan_chunks):,} orphaned chunk object(s)",
            f"dropped {done.quarantine_dropped:,} aged quarantined import(s)",
        ],
    )
    return 0


def _forget(args: argparse.Namespace) -> int:
    from catalog.forget import Selector, SelectorInvalid

    try:
        selector = Selector(identity=args.identity, model=args.model, namespace=args.namespace)
    except SelectorInvalid as e:
        raise UsageError(str(e)) from None
    with _vault(args) as (_, vault):
        try:
            survey = vault.forget(selector, dry_run=True)
            if args.dry_run or not survey.cuts:
                report = survey
            else:
                with progress(survey.cuts, "forget") as step:
                    report = vault.forget(selector, progress=step)
        except SelectorInvalid as e:
            raise UsageError(str(e)) from None
    verb = "would forget" if args.dry_run else "forgot"
    _emit(
        args,
        report.to_json(),
        lambda: [
            f"{verb} {report.cuts:,} cut(s) ({format_size(report.bytes)}) of {selector}: "
            f"{len(report.identities)} identit{'y' if len(report.identities) == 1 else 'ies'}",
            *[f"    {d}" for d in report.identities],
            *(
                []
                if args.dry_run or not report.cuts
                else ["unreachable now; GC reclaims their chunks after the grace period"]
            ),
        ],
    )
    if not report.cuts:
        print(f"{PROG} forget: no cut of {selector} to forget", file=sys.stderr)
        return 1
    return 0


def _quota(args: argparse.Namespace) -> int:
    from catalog import quotas

    with _vault(args) as (_, vault):
        if args.quota_action == "set":
            with vault.transaction() as s:
                quotas.set_quota(
                    session=s, namespace=args.tenant, limit=args.size, now=datetime.now(UTC)
                )
        elif args.quota_action == "clear":
            with vault.transaction() as s:
                if not quotas.clear_quota(session=s, namespace=args.tenant):
                    raise UsageError(f"tenant {args.tenant!r} has no quota")
        tenants = vault.stats().tenants
    rows = [t for t in tenants if t.quota is not None]
    doc = [{"namespace": t.namespace, "quota": t.quota, "footprint": t.footprint} for t in rows]
    _emit(
        args,
        doc,
        lambda: (
            [f"{'tenant':<16} {'quota':>11} {'footprint':>11} {'used':>7}"]
            + [
                f"{_cut(t.namespace, 16):<16} {format_size(t.quota):>11} "
                f"{format_size(t.footprint):>11} {_use(t.footprint, t.quota):>7}"
                for t in rows
            ]
        ),
    )
    return 0


def _condemned(args: argparse.Namespace) -> int:
    from catalog.condemn import recent

    with _vault(args) as (_, vault):
        found = vault.read(lambda s: recent(session=s, limit=args.limit))
    rows = [
        {
            "manifest": r.manifest,
            "identity": r.identity,
            "depth": r.depth,
            "kind": r.kind,
            "reason": r.reason,
            "chunk": r.chunk,
            "condemned_at": r.condemned_at.isoformat(),
        }
        for r in found
    ]
    _emit(
        args,
        rows,
        lambda: (
            [
                f"{r.condemned_at.isoformat()[:19]}  {r.manifest}  {r.identity[:12]}  "
                f"depth {r.depth:>7,}  {r.kind}: {_cut(r.reason, 80)}"
                for r in found
            ]
            or ["no cut has been condemned"]
        ),
    )
    return 0


def _run_json(run: Any) -> dict[str, Any] | None:
    if run is None:
        return None
    return {
        "holder": run.holder,
        "finished_at": run.finished_at.isoformat(),
        "outcome": run.outcome,
        "details": run.details,
    }


def _run_line(run: Any) -> str:
    if run is None:
        return "never"
    return f"{_when(run.finished_at)}: {run.outcome} (by {run.holder})"


def _by(counts: dict[str, int]) -> str:
    return ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())) or "none"


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


ACTIONS: dict[str, Callable[[argparse.Namespace], int]] = {
    "stats": _stats,
    "ls": _ls,
    "verify": _verify,
    "gc": _gc,
    "forget": _forget,
    "quota": _quota,
    "condemned": _condemned,
}
