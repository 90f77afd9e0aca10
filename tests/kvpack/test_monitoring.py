"""The monitoring files in infra/ point at what kvpack exposes: every metric the Grafana
dashboard queries is on /metrics (with the vault gauges read), the Prometheus example
scrapes /metrics with the admin key compose's kvpack-keys writes, and compose's
monitoring profile mounts files that exist."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath

import yaml
from sqlalchemy.orm import Session

from catalog import quotas
from kvpack.maintainer import Maintainer
from kvpack.service.service import CompletionRequest
from tests.engine.slotkit import prompt
from tests.infra.files import compose

INFRA = Path(__file__).resolve().parents[2] / "infra"
DASHBOARD = INFRA / "grafana" / "dashboards" / "kvpack.json"
SUFFIXES = ("_bucket", "_count", "_sum", "_total", "_created")


def exposed_families(settings, open_service) -> set[str]:
    svc = open_service(settings)
    p = prompt(130, seed=61)
    for _ in range(2):
        svc.complete(CompletionRequest(tokens=p, max_tokens=2))
        assert svc.flush(60)
    with Session(svc.vault.db) as s, s.begin():
        quotas.set_quota(session=s, namespace="default", limit=1 << 30, now=datetime.now(UTC))
    m = Maintainer(
        vault=svc.vault,
        quarantine=svc.quarantine,
        accounting=svc.accounting,
        budget_bytes=1 << 30,
        gc_interval_s=0,
    )
    assert m.collect_once().outcome == "ok" and m.verify_once().outcome == "ok"
    m.refresh()
    body, _ = svc.accounting.render()
    return set(re.findall(r"^# TYPE (\S+) ", body.decode(), re.M))


def test_every_metric_the_dashboard_queries_is_exposed(settings, open_service):
    doc = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in doc["panels"] for t in p["targets"]]
    named = {m for e in exprs for m in re.findall(r"\bkvpack_[a-z_]+", e)}
    families = exposed_families(settings, open_service)
    missing = set()
    for name in named:
        base = next((name[: -len(s)] for s in SUFFIXES if name.endswith(s)), name)
        if name not in families and base not in families:
            missing.add(name)
    assert named and missing == set()
    titles = " ".join(p["title"] for p in doc["panels"]).lower()
    for topic in ("hit rate", "bytes served", "restore", "prefill", "cold", "budget"):
        assert topic in titles, topic


def test_prometheus_scrapes_metrics_with_an_admin_key_and_compose_mounts_what_exists():
    prom = yaml.safe_load((INFRA / "prometheus.yml").read_text())
    job = next(j for j in prom["scrape_configs"] if j["job_name"] == "kvpack")
    assert job["metrics_path"] == "/metrics" and job["authorization"]["type"] == "Bearer"
    services = compose()["services"]
    assert {"prometheus", "grafana"} <= {
        n for n, s in services.items() if "monitoring" in s.get("profiles", ())
    }
    mounts = {
        name: dict(v.split(":")[:2] for v in s.get("volumes", ())) for name, s in services.items()
    }
    for source in (s for m in mounts.values() for s in m if s.startswith("./")):
        assert (INFRA / source).exists(), source
    assert mounts["prometheus"]["./prometheus.yml"] == "/etc/prometheus/prometheus.yml"
    # The key kvpack-keys writes is the file Prometheus reads, through one volume.
    written = PurePosixPath(services["kvpack-keys"]["environment"]["KVPACK_METRICS_KEY_FILE"])
    volume = next(v for v, at in mounts["kvpack-keys"].items() if at == str(written.parent))
    read = PurePosixPath(mounts["prometheus"][volume]) / written.name
    assert job["authorization"]["credentials_file"] == str(read)
    datasource = yaml.safe_load(
        (INFRA / "grafana/provisioning/datasources/prometheus.yaml").read_text()
    )["datasources"][0]
    uids = {
        t["datasource"]["uid"]
        for p in json.loads(DASHBOARD.read_text())["panels"]
        for t in p["targets"]
    }
    assert uids == {datasource["uid"]}
