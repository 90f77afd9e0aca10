"""The status page (kvpack/server/status.py) in a real headless Chromium: every number on
it equals /metrics, the hit rate is /metrics' hits over hits and misses, the plot has a
point per first token /metrics counted; and who may see it (admin keys, also as a
browser's Basic auth password)."""

from __future__ import annotations

import base64
import os
import shutil
from datetime import UTC, datetime

import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy.orm import Session

from catalog import access, quotas
from kvpack.maintainer import Maintainer
from kvpack.server.auth import catalog_authenticator
from kvpack.service.service import CompletionRequest, Service
from tests.engine.slotkit import prompt
from tests.kvpack.serverkit import call, running

CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)


def browser_unavailable(reason: str) -> None:
    """Fail under CI (the browser test must run there), skip elsewhere."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"headless Chromium required under CI=true: {reason}", pytrace=False)
    pytest.skip(f"no headless Chromium: {reason} (make setup installs it on Debian/Ubuntu)")


@pytest.fixture
def browser(tmp_path):
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service as DriverService
    except ImportError as e:
        browser_unavailable(f"selenium is not installed ({e})")
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    if binary is None or driver_path is None:
        browser_unavailable("chromium or chromedriver is not on PATH")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'chromium'}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=DriverService(executable_path=driver_path), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def metrics(url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    status, _, body = call(url, "GET", "/metrics")
    assert status == 200
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def total(found, name: str, **labels: str) -> float:
    values = [v for ls, v in found.get(name, ()) if labels.items() <= ls.items()]
    assert values, f"{name}{labels} is not in /metrics"
    return sum(values)


def busy_service(open_service, settings) -> tuple[Service, Maintainer]:
    """A service with cold, warm and durable traffic in two tenants, a quota, one GC pass
    recorded and the gauges read."""
    svc = open_service(settings)
    p, q = prompt(200, seed=41), prompt(200, seed=42)
    for tokens, namespace in ((p, "default"), (p, "default"), (q, "acme"), (p, "default")):
        svc.complete(CompletionRequest(tokens=tokens, max_tokens=4, namespace=namespace))
        assert svc.flush(60)
    with Session(svc.vault.db) as s, s.begin():
        quotas.set_quota(session=s, namespace="acme", limit=50 << 20, now=datetime.now(UTC))
    maintainer = Maintainer(
        vault=svc.vault,
        quarantine=svc.quarantine,
        accounting=svc.accounting,
        budget_bytes=64 << 20,
        gc_interval_s=0,
    )
    assert maintainer.collect_once().outcome == "ok"
    maintainer.refresh()
    return svc, maintainer


def test_the_status_page_in_chromium_shows_what_metrics_shows(settings, open_service, browser):
    from selenium.webdriver.common.by import By

    svc, _ = busy_service(open_service, settings)
    with running(svc) as url:
        browser.get(url + "/")
        cells = [
            (e.get_attribute("data-metric"), e.get_attribute("data-labels"), e.text)
            for e in browser.find_elements(By.CSS_SELECTOR, ".m")
        ]
        rate = browser.find_element(By.ID, "hit-rate").text
        dots = {
            kind: len(browser.find_elements(By.CSS_SELECTOR, f"#ttft circle.{kind}"))
            for kind in ("cold", "warm")
        }
        title = browser.title
        identity = browser.find_element(By.ID, "identity").text
        found = metrics(url)
    assert title == "kvpack: tiny" and identity == svc.loaded.identity.hex
    shown = {}
    for name, labels, text in cells:
        want = dict(kv.split("=", 1) for kv in labels.split(",") if kv)
        if text == "-":
            assert not any(want.items() <= ls.items() for ls, _ in found.get(name, ())), name
            continue
        assert float(text) == pytest.approx(total(found, name, **want), rel=1e-5), (name, want)
        shown[(name, labels)] = float(text)
    must = {
        ("kvpack_vault_footprint_bytes", ""),
        ("kvpack_vault_budget_bytes", ""),
        ("kvpack_vault_manifests", ""),
        ("kvpack_hits_total", "tier=resident"),
        ("kvpack_misses_total", ""),
        ("kvpack_tenant_footprint_bytes", "namespace=acme"),
        ("kvpack_tenant_footprint_bytes", "namespace=default"),
        ("kvpack_tenant_quota_bytes", "namespace=acme"),
        ("kvpack_gc_last_success", ""),
    }
    assert must <= set(shown), must - set(shown)
    assert shown[("kvpack_vault_budget_bytes", "")] == 64 << 20
    assert shown[("kvpack_hits_total", "tier=resident")] == 2  # the repeats
    assert shown[("kvpack_vault_footprint_bytes", "")] == svc.vault.stats().total.footprint
    hits = total(found, "kvpack_hits_total")
    assert rate == f"{hits / (hits + total(found, 'kvpack_misses_total')):.4f}"
    cold = total(found, "kvpack_first_token_seconds_count", tier="none")
    assert dots == {"cold": cold, "warm": total(found, "kvpack_first_token_seconds_count") - cold}
    assert dots["cold"] == 2 and dots["warm"] == 2


def test_the_status_page_is_for_admin_keys_and_browsers_may_use_basic_auth(settings, open_service):
    """No key: 401 with a Basic challenge (a browser prompts for it); a tenant key: 403;
    an admin key as a bearer token or as a Basic password: the page."""
    svc = open_service(settings)
    with Session(svc.vault.db) as s, s.begin():
        admin = access.create_key(session=s, role="admin", namespace="*")
        tenant = access.create_key(session=s, role="tenant", namespace="acme")
    with running(svc, authenticate=catalog_authenticator(svc.vault.db)) as url:
        status, headers, _ = call(url, "GET", "/")
        assert status == 401 and headers["WWW-Authenticate"].startswith("Basic")
        assert call(url, "GET", "/", token=tenant)[0] == 403
        status, headers, body = call(url, "GET", "/", token=admin)
        assert status == 200 and b"<h1>kvpack</h1>" in body
        basic = "Basic " + base64.b64encode(f"operator:{admin}".encode()).decode()
        assert call(url, "GET", "/", authorization=basic)[0] == 200
        wrong = "Basic " + base64.b64encode(b"operator:kvp_wrong").decode()
        assert call(url, "GET", "/", authorization=wrong)[0] == 401
        assert call(url, "GET", "/v1/models", authorization=basic)[0] == 401  # Bearer only
