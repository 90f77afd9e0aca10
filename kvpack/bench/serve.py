"""The cold/warm/miss/durable bench: what a repeated prompt costs on a server that never
saw it, and on a restarted one.

- attempt: one depth on one fresh `kvpack serve --measure-restores` process (its own
  data dir and a unique namespace, so neither this machine's earlier runs nor a shared
  bucket and database can warm it), six legs, the baselines, one receipt. Attempt id:
  <UTC time>-<random hex>-d<depth>. A depth must leave room for the generated tokens in
  the model's context (`check_depths`).
- leg: one streamed /v1/completions request, greedy, prompt sent as token ids:
  cold (a prompt of exactly `depth` tokens), warm (the same prompt again: the resident
  tier's turn), miss (an unrelated prompt of `miss_depth` tokens through the same path:
  the control, which no tier should serve), second (another prompt of the same depth,
  cold: published for the restarted server), durable (the first prompt once more, on a
  NEW server process over the same data dir, store, catalog and namespace, started
  after the first one stopped gracefully, which drains its publication: an empty
  resident tier, so only the durable tier can serve), durable_second (the second prompt
  on the restarted server: also a durable restore, so first / second request after a
  restart compares like with like; `restarts` > 1 repeats the restart and both legs as
  "durable@2", "durable_second@2", … so that ratio is judged on more than one pair).
  Per leg: time to first token and each streamed token's arrival, total time, tier,
  output, the server's /metrics counters before and after, and the server's own record
  of the leg's restore (GET /v1/admin/restores: seconds, bytes, peak RSS added).
  Before each leg the bench waits for the server's publication queue to drain
  (GET /healthz), recorded as `publication_before`.
- baselines: after the restarted server stopped, the first prompt's state through
  kvpack's API saved as an mlx-lm prompt cache, mlx-lm's load + one step, and the floor
  of the cut's bytes; on S3, before each restarted server starts, a raw GET of the cut
  each of its durable legs restores (`s3_get` on the leg; kvpack/bench/probe.py), so a
  restore and its GET read the store in the same state and within a minute. One GET
  after the whole run read files the restores had just brought back into the S3
  server's page cache, and judged restores against the VM's speed ten minutes later
  (docs/measurements.md, *each durable leg judged against a GET of its own cut*). The
  figures and targets are kvpack/bench/figures.py's, filled by `judge`.
- valid leg: answered 200 and finished (finish reason, kvpack object, [DONE]) within its
  timeout, which grows with the depth. An invalid leg is never a correctness result:
  `outputs_match` compares cold and warm, `outputs_match_durable` cold and durable,
  `outputs_match_durable_second` second and durable_second (every restart's), each only
  when all its legs are valid (else it is None).
- receipt: the attempt as JSON, created exclusively (never overwritten) as
  <receipts dir>/<attempt id>.json.
"""

from __future__ import annotations

import http.client
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from prometheus_client.parser import text_string_to_metric_families

from kvpack.bench.figures import (
    FIGURES_HEADER,
    base_leg,
    format_figures,
    judge_figures,
    num,
    restart_legs,
)
from kvpack.bench.probe import measure_baseline, measure_gets, vault_settings
from kvpack.config import Settings

RECEIPT_VERSION = 3
LEGS = ("cold", "warm", "miss", "second", "durable", "durable_second")
FIRST_SERVER_LEGS = ("cold", "warm", "miss", "second")
PROMPT_OF = {"cold": "cold", "warm": "cold", "miss": "miss", "second": "second",
             "durable": "cold", "durable_second": "second"}  # fmt: skip
_WORD_LIST = (
    "amber basalt cedar delta ember fjord granite harbor indigo juniper kelp lantern meadow "
    "nickel orchard pebble quartz river saffron timber umber velvet willow xenon yarrow zephyr"
)
WORDS = tuple(_WORD_LIST.split())


class BenchError(Exception):
    """The bench could not run an attempt at all (e.g. the server never became ready)."""


class BadDepth(BenchError, ValueError):
    """A depth the model cannot take (it must leave room for the generated tokens)."""


def check_depths(
    depths: Sequence[int], *, context_length: int, max_tokens: int, model: str
) -> None:
    """Every depth plus the generated tokens fits the model's context; else BadDepth."""
    room = context_length - max_tokens
    bad = [d for d in depths if not 1 <= d <= room]
    if bad:
        raise BadDepth(f"depth(s) {bad} do not fit {model}: a depth plus --max-tokens "
                       f"{max_tokens} must be within its context of {context_length} tokens, "
                       f"so depths are 1..{room}")  # fmt: skip


class ReceiptExists(BenchError, FileExistsError):
    """A receipt with this attempt id already exists; receipts are never overwritten."""

    def __init__(self, path: Path) -> None:
        super().__init__(f"receipt {path} already exists (receipts are never overwritten)")
        self.path = path


class LegFailed(Exception):
    """A leg did not finish properly; the message says how."""


# -- prompts ---------------------------------------------------------------------------


def passage(seed: int, sentences: int, *, title: str) -> str:
    """Deterministic prose: numbered sentences over a fixed word list (a small LCG)."""
    state, out = seed, [title]
    for i in range(sentences):
        picks = []
        for _ in range(4):
            state = (state * 1103515245 + 12345) % 2**31
            picks.append(WORDS[state % len(WORDS)])
        out.append(f"Entry {i + 1}: the {picks[0]} {picks[1]} by the {picks[2]} {picks[3]} "
                   f"holds {state % 997} units.")  # fmt: skip
    return " ".join(out)


def prompt_tokens(tokenizer: Any, depth: int, *, seed: int, title: str) -> list[int]:
    """Exactly `depth` token ids of deterministic text, cut from the tokenizer's encoding."""
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    sentences = max(8, depth // 8)
    while True:
        ids = tokenizer.encode(passage(seed, sentences, title=title))
        if len(ids) >= depth:
            return list(ids[:depth])
        sentences *= 2


# -- one leg -----------------------------------------------------------------------------


def scrape(base_url: str, *, timeout_s: float = 10.0) -> dict[str, float]:
    """The server's counters (GET /metrics), summed over labels except the tier."""
    status, body = _get(base_url, "/metrics", timeout_s)
    if status != 200:
        raise LegFailed(f"GET /metrics answered {status}")
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            if s.name.endswith(("_created", "_bucket")):
                continue
            key = f"{s.name}:{s.labels['tier']}" if "tier" in s.labels else s.name
            out[key] = out.get(key, 0.0) + s.value
    return out


def _connection(base_url: str, timeout_s: float) -> http.client.HTTPConnection:
    parts = urlsplit(base_url)
    if parts.hostname is None:
        raise ValueError(f"not an http://host:port URL: {base_url!r}")
    return http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s)


def _get(base_url: str, path: str, timeout_s: float) -> tuple[int, bytes]:
    conn = _connection(base_url, timeout_s)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def server_restores(base_url: str, *, timeout_s: float = 10.0) -> list[dict[str, Any]] | None:
    """The server's restore records (GET /v1/admin/restores); None when it does not
    measure them (404)."""
    status, body = _get(base_url, "/v1/admin/restores", timeout_s)
    if status == 404:
        return None
    if status != 200:
        raise LegFailed(f"GET /v1/admin/restores answered {status}")
    restores: list[dict[str, Any]] = json.loads(body)["restores"]
    return restores


def settle(base_url: str, *, timeout_s: float) -> dict[str, Any]:
    """Wait until the server's publication queue is empty (GET /healthz), so a warm leg
    measures what the vault holds after the cold run, not a race with its publisher."""
    t0 = time.perf_counter()
    while True:
        status, body = _get(base_url, "/healthz", 10.0)
        publication = json.loads(body).get("publication") if status == 200 else None
        waited = time.perf_counter() - t0
        if publication is None or publication.get("queued", 0) == 0:
            return {"settled": publication is not None, "waited_s": waited, "stats": publication}
        if waited > timeout_s:
            return {"settled": False, "waited_s": waited, "stats": publication}
        time.sleep(0.05)


def run_leg(
    base_url: str,
    name: str,
    tokens: Sequence[int],
    *,
    model: str,
    max_tokens: int,
    timeout_s: float,
) -> dict[str, Any]:
    """One streamed completion, timed; never raises for the server's failures."""
    leg: dict[str, Any] = {"leg": name, "prompt_tokens_sent": len(tokens), "timeout_s": timeout_s,
                           "valid": False, "error": None,
                           "started_at": datetime.now(UTC).isoformat()}  # fmt: skip
    try:
        leg["publication_before"] = settle(base_url, timeout_s=timeout_s)
        leg["counters_before"] = scrape(base_url)
        restores_before = server_restores(base_url)
        leg.update(
            _stream(base_url, tokens, model=model, max_tokens=max_tokens, timeout_s=timeout_s)
        )
        leg["counters_after"] = after = scrape(base_url)
        restores = server_restores(base_url)
        leg["server_restores"] = (None if restores is None or restores_before is None
                                  else restores[len(restores_before):])  # fmt: skip
        before = leg["counters_before"]
        leg["counters_delta"] = {
            k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)
        }
        if leg["prompt_tokens"] != len(tokens):
            raise LegFailed(
                f"server counted {leg['prompt_tokens']} prompt tokens, sent {len(tokens)}"
            )
        leg["valid"] = True
    except TimeoutError:
        leg["error"] = f"timed out after {timeout_s:.0f}s"
    except (LegFailed, OSError, http.client.HTTPException, ValueError, KeyError) as e:
        leg["error"] = f"{type(e).__name__}: {e}"
    return leg


def _stream(
    base_url: str, tokens: Sequence[int], *, model: str, max_tokens: int, timeout_s: float
) -> dict[str, Any]:
    body = {"model": model, "prompt": list(tokens), "max_tokens": max_tokens, "temperature": 0,
            "seed": 0, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    t0 = time.perf_counter()
    deadline = t0 + timeout_s
    conn = _connection(base_url, timeout_s)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body),
                     headers={"Content-Type": "application/json"})  # fmt: skip
        resp = conn.getresponse()
        if resp.status != 200:
            raise LegFailed(f"HTTP {resp.status}: {resp.read(500).decode(errors='replace')}")
        text, times, finish, kvpack, usage, done = [], [], None, None, None, False
        while not done:
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                raise TimeoutError
            conn.sock.settimeout(remaining)
            line = resp.readline()
            if not line:
                raise LegFailed("the stream ended before [DONE]")
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
                continue
            chunk = json.loads(data)
            if "error" in chunk:
                raise LegFailed(f"server error mid-stream: {chunk['error'].get('message')}")
            for choice in chunk.get("choices", []):
                if choice.get("text"):
                    times.append(time.perf_counter() - t0)
                    text.append(choice["text"])
                finish = choice.get("finish_reason") or finish
            kvpack = chunk.get("kvpack", kvpack)
            usage = chunk.get("usage", usage)
        total = time.perf_counter() - t0
    finally:
        conn.close()
    if finish is None or kvpack is None or usage is None:
        raise LegFailed("the stream carried no finish reason, kvpack object or usage")
    return {
        "ttft_s": times[0] if times else None,
        "token_times_s": times,  # each streamed text's arrival, from the request
        "total_s": total,
        "tier": kvpack["tier"],
        "cached_tokens": kvpack["cached_tokens"],
        "restore_seconds": kvpack["restore_seconds"],
        "prefill_seconds": kvpack["prefill_seconds"],
        "prompt_tokens": usage["prompt_tokens"],
        "completion_tokens": usage["completion_tokens"],
        "finish_reason": finish,
        "output": "".join(text),
    }


# -- one attempt -------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    model: str  # the spec `kvpack serve --model` loads
    depths: tuple[int, ...]
    work_dir: Path  # each attempt gets a fresh data dir under it
    receipts_dir: Path
    storage_argv: tuple[str, ...] = ()  # storage flags for `kvpack serve` (no --data-dir)
    namespace: str = "bench"  # each attempt serves namespace "<namespace>-<attempt id>"
    miss_depth: int = 256
    max_tokens: int = 16
    restarts: int = 1  # restarted servers, each with both durable legs
    timeout_base_s: float = 60.0
    timeout_per_token_s: float = 0.5
    startup_timeout_s: float = 300.0
    serve_argv: tuple[str, ...] = ()  # more `kvpack serve` flags (e.g. --alignment)
    python: str = field(default_factory=lambda: sys.executable)
    served_as: str | None = None  # the name the server answers to, if not the spec (a path)

    @property
    def model_name(self) -> str:
        return self.served_as or self.model

    def leg_timeout(self, depth: int) -> float:
        return self.timeout_base_s + self.timeout_per_token_s * (depth + self.max_tokens)


def new_run_id() -> str:
    return f"{datetime.now(UTC):%Y%m%dT%H%M%SZ}-{secrets.token_hex(4)}"


def write_receipt(receipts_dir: Path, attempt_id: str, receipt: dict[str, Any]) -> Path:
    """Create <attempt id>.json exclusively; an existing receipt raises ReceiptExists."""
    receipts_dir.mkdir(parents=True, exist_ok=True)
    path = receipts_dir / f"{attempt_id}.json"
    try:
        with path.open("x") as f:
            json.dump(receipt, f, indent=2, sort_keys=True)
            f.write("\n")
    except FileExistsError:
        raise ReceiptExists(path) from None
    return path


def leg_names(restarts: int) -> tuple[str, ...]:
    """Every leg of an attempt in the order run: LEGS, then each further restart's two."""
    return LEGS + tuple(n for r in range(2, restarts + 1) for n in restart_legs(r))


def judge(receipt: dict[str, Any]) -> None:
    """The validity gate: fill legs_valid, leg_errors, outputs_match(_durable, _durable_
    second), the TTFT ratios and the tiers; a comparison with an invalid leg is None (not
    judged). Then the figures and targets (kvpack/bench/figures.py)."""
    legs = receipt["legs"]
    names = leg_names(receipt.get("restarts", 1))
    errors = {n: (legs[n]["error"] if n in legs else "not run") for n in names}
    receipt["leg_errors"] = {n: e for n, e in errors.items() if e is not None}
    receipt["legs_valid"] = not receipt["leg_errors"]
    valid = {n: legs[n] if errors[n] is None else None for n in names}
    cold, warm, miss, durable = (valid[n] for n in ("cold", "warm", "miss", "durable"))

    def match(a: dict[str, Any] | None, *others: dict[str, Any] | None) -> bool | None:
        if a is None or any(b is None for b in others):
            return None
        out = (a["output"], a["completion_tokens"])
        return all(out == (b["output"], b["completion_tokens"]) for b in others if b)

    def ratio(other: dict[str, Any] | None) -> float | None:
        if cold and other and cold["ttft_s"] and other["ttft_s"]:
            return cold["ttft_s"] / other["ttft_s"]
        return None

    receipt["outputs_match"] = match(cold, warm)
    firsts = [n for n in names if base_leg(n) == "durable"]
    receipt["outputs_match_durable"] = match(cold, *(valid[n] for n in firsts))
    receipt["outputs_match_durable_second"] = match(
        valid["second"], *(valid[n] for n in names if base_leg(n) == "durable_second")
    )
    receipt["ttft_ratio_cold_to_warm"] = ratio(warm)
    receipt["ttft_ratio_cold_to_durable"] = ratio(durable)
    receipt["warm_tier"] = warm["tier"] if warm else None
    receipt["durable_tier"] = durable["tier"] if durable else None
    receipt["miss_served_by_no_tier"] = None if miss is None else miss["tier"] == "none"
    judge_figures(receipt, names)


class ServerProcess:
    """A `kvpack serve` child on a free loopback port; stopped (TERM, then KILL) on exit."""

    def __init__(self, argv: list[str], log_path: Path, startup_timeout_s: float) -> None:
        self.argv, self.log_path, self.startup_timeout_s = argv, log_path, startup_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        self.startup_s = 0.0
        self.exit_code: int | None = None  # after stop(): 0 is a clean (drained) exit

    def __enter__(self) -> ServerProcess:
        from kvpack.server.app import READY

        t0 = time.perf_counter()
        with self.log_path.open("wb") as log:
            env = {**os.environ, "PYTHONUNBUFFERED": "1"}
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            while not self.url:
                for line in self.log_path.read_text(errors="replace").splitlines():
                    if line.startswith(READY):
                        self.url = line[len(READY) :].strip()
                if self.url:
                    break
                if self.proc.poll() is not None:
                    raise BenchError(f"server exited ({self.proc.returncode}): {self._tail()}")
                if time.perf_counter() - t0 > self.startup_timeout_s:
                    raise BenchError(f"server not ready after {self.startup_timeout_s:.0f}s")
                time.sleep(0.1)
            status, _ = _get(self.url, "/healthz", 10.0)
            if status != 200:
                raise BenchError(f"GET /healthz answered {status}")
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.perf_counter() - t0
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """SIGTERM (the server drains its publication and exits), SIGKILL after 60 s."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.exit_code = self.proc.returncode

    def record(self) -> dict[str, Any]:
        return {"url": self.url, "pid": self.proc.pid if self.proc else None,
                "startup_s": self.startup_s, "log": str(self.log_path)}  # fmt: skip

    def _tail(self, n: int = 800) -> str:
        return self.log_path.read_text(errors="replace")[-n:]


def redact_argv(argv: Sequence[str]) -> list[str]:
    """argv for a receipt: no secret key, no database password."""
    from catalog.db import redacted

    out = list(argv)
    for i, arg in enumerate(out[:-1]):
        if arg == "--s3-secret-key":
            out[i + 1] = "***"
        elif arg == "--database-url":
            out[i + 1] = redacted(out[i + 1])
    return out


def run_attempt(
    plan: Plan, depth: int, prompts: dict[str, list[int]], *, run_id: str
) -> tuple[dict[str, Any], Path]:
    """One depth: cold, warm, miss and second on a fresh server, then durable and
    durable_second on a restarted one (same data dir and namespace; `plan.restarts` times),
    then the baselines; judged, and a receipt written."""
    attempt_id = f"{new_run_id()}-d{depth}"  # its own random part: a depth may repeat
    data_dir = plan.work_dir / attempt_id
    data_dir.mkdir(parents=True)
    namespace = f"{plan.namespace}-{attempt_id}"
    vault_argv = ["--data-dir", str(data_dir), "--namespace", namespace, *plan.storage_argv,
                  *plan.serve_argv]  # fmt: skip
    # --no-auth: the child listens on loopback only and serves this bench alone.
    argv = [plan.python, "-m", "kvpack.cli", "serve", "--host", "127.0.0.1", "--port", "0",
            "--no-auth", "--measure-restores", "--model", plan.model, *vault_argv]  # fmt: skip
    receipt: dict[str, Any] = {
        "kind": "kvpack.bench.attempt",
        "version": RECEIPT_VERSION,
        "attempt_id": attempt_id,
        "run_id": run_id,
        "started_at": datetime.now(UTC).isoformat(),
        "model": plan.model,
        "depth": depth,
        "miss_depth": plan.miss_depth,
        "max_tokens": plan.max_tokens,
        "restarts": plan.restarts,
        "namespace": namespace,
        "server": {"argv": redact_argv(argv)},
        "legs": {},
    }
    servers = [("server", "serve.log", FIRST_SERVER_LEGS),
               ("restarted_server", "serve-restarted.log", restart_legs(1))]  # fmt: skip
    servers += [(f"restarted_server@{r}", f"serve-restarted-{r}.log", restart_legs(r))
                for r in range(2, plan.restarts + 1)]  # fmt: skip
    storage: dict[str, Any] = vault_settings(vault_argv)
    on_s3 = Settings.load(**storage).store_url.is_s3
    probe_timeout_s = plan.startup_timeout_s + plan.leg_timeout(depth)
    try:
        for key, log, names in servers:
            gets = None
            if on_s3 and key != "server":  # each durable leg's own GET, just before it
                cuts = {name: prompts[PROMPT_OF[base_leg(name)]] for name in names}
                gets = measure_gets(python=plan.python, model=plan.model, vault_argv=vault_argv,
                                    cuts=cuts, timeout_s=probe_timeout_s)  # fmt: skip
                receipt[key] = {"s3_get_error": gets.pop("error")}
            server = ServerProcess(argv, data_dir / log, plan.startup_timeout_s)
            receipt[key] = {**receipt.get(key, {}), "log": str(server.log_path)}
            with server:
                receipt[key].update(server.record())
                for name in names:
                    tokens = prompts[PROMPT_OF[base_leg(name)]]
                    leg = run_leg(server.url, name, tokens, model=plan.model_name,
                                  max_tokens=plan.max_tokens,
                                  timeout_s=plan.leg_timeout(len(tokens)))  # fmt: skip
                    if gets is not None:
                        leg["s3_get"] = gets.get(name)
                    receipt["legs"][name] = leg
            receipt[key]["exit_code"] = server.exit_code
        receipt["baseline"] = measure_baseline(
            python=plan.python, model=plan.model, vault_argv=vault_argv,
            tokens=prompts["cold"], work_dir=data_dir, timeout_s=probe_timeout_s,
        )  # fmt: skip
    except BenchError as e:
        receipt["server_error"] = str(e)
    receipt["finished_at"] = datetime.now(UTC).isoformat()
    judge(receipt)
    return receipt, write_receipt(plan.receipts_dir, attempt_id, receipt)


def run_bench(plan: Plan, tokenizer: Any, *, out: Any = None) -> list[dict[str, Any]]:
    """Every depth of the plan, one fresh server each; prints rows as they come."""
    out = out or sys.stdout
    run_id = new_run_id()
    miss = prompt_tokens(tokenizer, plan.miss_depth, seed=2, title="Unrelated control passage.")
    receipts = []
    for depth in plan.depths:
        prompts = {
            "cold": prompt_tokens(tokenizer, depth, seed=1, title="Field notes of the survey."),
            "second": prompt_tokens(tokenizer, depth, seed=3, title="Minutes of the harbor board."),
            "miss": miss,
        }
        receipt, path = run_attempt(plan, depth, prompts, run_id=run_id)
        receipt["receipt_path"] = str(path)
        print(format_attempt(receipt), file=out, flush=True)
        receipts.append(receipt)
    return receipts


HEADER = (f"{'depth':>6} {'leg':<16} {'tier':<9} {'cached':>6} {'ttft_s':>8} {'total_s':>8} "
          f"{'cold/leg':>8}  valid")  # fmt: skip


def format_attempt(receipt: dict[str, Any]) -> str:
    def times(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f}x"

    ratios = {"warm": receipt["ttft_ratio_cold_to_warm"],
              "durable": receipt["ttft_ratio_cold_to_durable"]}  # fmt: skip
    rows = [HEADER]
    for name in leg_names(receipt.get("restarts", 1)):
        leg = receipt["legs"].get(name)
        if leg is None:
            rows.append(f"{receipt['depth']:>6} {name:<16} (not run)")
            continue
        valid = "yes" if leg["valid"] else f"NO ({leg['error']})"
        rows.append(f"{receipt['depth']:>6} {name:<16} {leg.get('tier', '-'):<9} "
                    f"{leg.get('cached_tokens', '-'):>6} {num(leg.get('ttft_s'), '.3f'):>8} "
                    f"{num(leg.get('total_s'), '.3f'):>8} {times(ratios.get(name)):>8}  "
                    f"{valid}")  # fmt: skip
    judged = {True: "yes", False: "NO", None: "not judged (invalid leg)"}
    summary = (
        f"depth {receipt['depth']}: cold/warm TTFT {times(ratios['warm'])}, "
        f"cold/durable TTFT {times(ratios['durable'])}, warm tier {receipt['warm_tier']}, "
        f"durable tier {receipt['durable_tier']}, "
        f"outputs_match {judged[receipt['outputs_match']]}, "
        f"outputs_match_durable {judged[receipt['outputs_match_durable']]}, "
        f"outputs_match_durable_second {judged[receipt['outputs_match_durable_second']]}"
    )
    if "server_error" in receipt:
        summary += f", server error: {receipt['server_error']}"
    return "\n".join([*rows, FIGURES_HEADER, format_figures(receipt), summary,
                      f"  receipt {receipt.get('receipt_path', '-')}"])  # fmt: skip


def passed(receipts: Sequence[dict[str, Any]]) -> bool:
    return all(
        r["legs_valid"]
        and r["outputs_match"]
        and r["outputs_match_durable"]
        and r["outputs_match_durable_second"]
        for r in receipts
    )
