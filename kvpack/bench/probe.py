"""The bench's baselines for one cut, each in a fresh process while no server runs
(`python -m kvpack.bench.probe export|mlx-lm|s3-get`, the request a JSON object on stdin,
the answer one JSON line on stdout).

- export: open the vault as `kvpack serve` did (the same settings), take
  the state of `tokens` through kvpack's own API (`VaultClient.prompt_cache`: mlx-lm
  cache objects) and save it with mlx-lm's `save_prompt_cache`; report the cut's parts
  (plaintext sizes: what the floor is measured for) and the kind of store.
- measure_baseline: export and mlx-lm, then the floor (cas/floor.py) of the cut's part
  sizes, in the bench's own process.
- mlx-lm: load the model, then time `load_prompt_cache` of that file plus one decode step
  (the cut's first generated token through the model, evaluated) — what an mlx-lm user
  pays to resume the same state; `repeats` runs, each loading the file again.
- s3-get (measure_gets): on an S3 store, for each named prompt, a raw GET of its cut's
  chunk objects: fetched with aiobotocore (no seal, no verify), as many in flight as the
  store allows, best of `repeats` passes, the client made before the clock starts. The
  bench takes it just before each restarted server starts, for the two prompts that
  server's durable legs restore: each restore is judged against a GET of its own bytes,
  from the store as it was then, minutes apart and not after the whole run.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import engine  # noqa: F401  # first: it loads the fast BLAS, which must precede mlx.core

REPEATS = 3


class ProbeFailed(Exception):
    """A probe process failed or printed no answer; the message carries its stderr."""


def _probe(python: str, kind: str, request: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """Run one probe in a fresh process; its request goes on stdin (it may hold secrets)."""
    cmd = [python, "-m", "kvpack.bench.probe", kind]
    try:
        done = subprocess.run(cmd, input=json.dumps(request), capture_output=True, text=True,
                              timeout=timeout_s)  # fmt: skip
    except subprocess.TimeoutExpired:
        raise ProbeFailed(f"probe {kind} timed out after {timeout_s:.0f}s") from None
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise ProbeFailed(f"probe {kind} exited {done.returncode}: {done.stderr[-800:]}")
    answer: dict[str, Any] = json.loads(lines[-1])
    return answer


def vault_settings(argv: Sequence[str]) -> dict[str, str]:
    """`kvpack serve`'s storage flags (`--name value` pairs) as settings overrides."""
    if len(argv) % 2 or not all(flag.startswith("--") for flag in argv[::2]):
        raise ValueError(f"not --flag value pairs: {list(argv)!r}")
    pairs = zip(argv[::2], argv[1::2], strict=True)
    out = {flag[2:].replace("-", "_"): value for flag, value in pairs}
    if "config" in out:
        out["config_file"] = out.pop("config")
    return out


def measure_baseline(
    *,
    python: str,
    model: str,
    vault_argv: Sequence[str],
    tokens: Sequence[int],
    work_dir: Path,
    timeout_s: float,
) -> dict[str, Any]:
    """The baselines for the state of `tokens` in the vault that `kvpack serve`'s storage
    flags `vault_argv` name (its servers stopped): export (parts, kind of store), mlx-lm's
    load + one step, and the floor of the cut's part sizes on `work_dir`'s file system.
    A failed probe is `error`."""
    from cas.floor import measure_floor

    out: dict[str, Any] = {"export": None, "mlx_lm": None, "floor": None, "error": None}
    cache = str(work_dir / "baseline.safetensors")
    export = {"settings": vault_settings(vault_argv), "model": model, "tokens": list(tokens),
              "cache": cache}  # fmt: skip
    try:
        out["export"] = found = _probe(python, "export", export, timeout_s)
        step = {"model": model, "cache": cache, "token": found["first_token"],
                "repeats": REPEATS}  # fmt: skip
        out["mlx_lm"] = _probe(python, "mlx-lm", step, timeout_s)
    except ProbeFailed as e:
        out["error"] = str(e)
        return out
    floor = measure_floor(found["part_sizes"], directory=work_dir)
    out["floor"] = {"bytes": floor.bytes, "seconds": floor.seconds, "read_s": floor.read_s,
                    "open_s": floor.open_s, "hash_s": floor.hash_s}  # fmt: skip
    return out


def measure_gets(
    *,
    python: str,
    model: str,
    vault_argv: Sequence[str],
    cuts: Mapping[str, Sequence[int]],
    timeout_s: float,
) -> dict[str, Any]:
    """The s3-get probe for the cuts of `cuts` (name: prompt tokens) in the vault that
    `kvpack serve`'s storage flags `vault_argv` name, no server running: each name's raw
    GET, and `error` (None, or why the probe failed)."""
    request = {"settings": vault_settings(vault_argv), "model": model,
               "cuts": {name: list(tokens) for name, tokens in cuts.items()},
               "repeats": REPEATS}  # fmt: skip
    try:
        return {**_probe(python, "s3-get", request, timeout_s), "error": None}
    except ProbeFailed as e:
        return {"error": str(e)}


async def raw_get(config: Any, keys: Sequence[str], *, repeats: int = REPEATS) -> dict[str, Any]:
    """Seconds (best pass) and bytes of a plain aiobotocore GET of every key."""
    from aiobotocore.config import AioConfig
    from aiobotocore.session import get_session

    session = get_session()
    kwargs = config.client_kwargs()
    async with session.create_client(
        "s3", config=AioConfig(**config.botocore_options()), **kwargs
    ) as client:
        runs, nbytes = [], 0
        for _ in range(repeats):
            t0 = time.perf_counter()
            nbytes = await get_objects(client, config.bucket, keys, config.max_concurrency)
            runs.append(time.perf_counter() - t0)
    return {"seconds": min(runs), "runs_s": runs, "bytes": nbytes, "objects": len(keys),
            "concurrency": config.max_concurrency}  # fmt: skip


async def get_objects(client: Any, bucket: str, keys: Sequence[str], concurrency: int) -> int:
    """One pass of the raw GET: every key read whole with `client` (aiobotocore),
    `concurrency` in flight; the bytes read."""
    gate = asyncio.Semaphore(concurrency)

    async def one(key: str) -> int:
        async with gate:
            resp = await client.get_object(Bucket=bucket, Key=key)
            async with resp["Body"] as body:
                return len(await body.read())

    return sum(await asyncio.gather(*(one(k) for k in keys)))


def export(request: dict[str, Any]) -> dict[str, Any]:
    import mlx.core as mx
    from mlx_lm.models.cache import save_prompt_cache

    import kvpack
    from cas.s3 import S3Store
    from kvpack.config import Settings

    tokens, cache = request["tokens"], request["cache"]
    with kvpack.open(settings=Settings.load(**request["settings"])) as client:
        model = client.model(request["model"])
        restored = client.prompt_cache(model, tokens)
        if restored.depth != len(tokens) or restored.logits is None:
            witnessed = restored.logits is not None
            raise SystemExit(f"the vault holds {restored.depth} of {len(tokens)} tokens "
                             f"({restored.tier}), logits witnessed: {witnessed}")  # fmt: skip
        save_prompt_cache(cache, restored.caches)
        first = mx.argmax(restored.logits).item()
        vault = client.vault
        cut, parts = _exact_cut(client, model, tokens, "the prompt")
        out: dict[str, Any] = {
            "tier": restored.tier, "depth": restored.depth, "first_token": first,
            "restore_seconds": restored.restore_seconds, "cut_bytes": cut.bytes,
            "manifest": cut.manifest_id.hex,
            "part_sizes": [p.size for p in parts], "cache_file": cache,
            "cache_file_bytes": Path(cache).stat().st_size, "catalog": vault.db.dialect.name,
        }  # fmt: skip
        out["store"] = "s3" if isinstance(vault.objects, S3Store) else "local"
    return out


def s3_get(request: dict[str, Any]) -> dict[str, Any]:
    import kvpack
    from cas.chunks import ChunkStore
    from cas.s3 import S3Store
    from kvpack.config import Settings

    out: dict[str, Any] = {}
    with kvpack.open(settings=Settings.load(**request["settings"])) as client:
        model, store = client.model(request["model"]), client.vault.objects
        if not isinstance(store, S3Store):
            raise SystemExit(f"{store!r} is not an S3 store: there is no GET to time")
        for name, tokens in request["cuts"].items():
            cut, parts = _exact_cut(client, model, tokens, name)
            keys = [store.config.key_prefix + ChunkStore.key(p.chunk_id) for p in parts]
            got = asyncio.run(raw_get(store.config, keys, repeats=request["repeats"]))
            out[name] = {**got, "cut_bytes": cut.bytes, "manifest": cut.manifest_id.hex}
    return out


def _exact_cut(client: Any, model: Any, tokens: Sequence[int], name: str) -> tuple[Any, Any]:
    """The vault's cut of exactly `tokens` and its manifest's parts (sizes and chunk ids;
    no chunk is read); SystemExit naming `name` when the vault holds less."""
    scope = model.service.tenant(client.namespace).scope
    cut = client.vault.find(scope, scope.chain(tokens))
    if cut is None or cut.depth != len(tokens):
        held = 0 if cut is None else cut.depth
        raise SystemExit(f"the vault holds {held} of the {len(tokens)} tokens of {name}")
    return cut, client.vault.open_cut(cut, scope).manifest.parts


def mlx_lm(request: dict[str, Any]) -> dict[str, Any]:
    import mlx.core as mx
    from mlx_lm.models.cache import load_prompt_cache

    from engine.models import load_model

    model = load_model(request["model"]).model
    runs = []
    for _ in range(request["repeats"]):
        t0 = time.perf_counter()
        cache = load_prompt_cache(request["cache"])
        logits = model(mx.array([[request["token"]]]), cache=cache)
        mx.eval(mx.argmax(logits[0, -1]))
        runs.append(time.perf_counter() - t0)
    return {"first_s": runs[0], "seconds": min(runs), "runs_s": runs}


PROBES = {"export": export, "mlx-lm": mlx_lm, "s3-get": s3_get}


def main(argv: Sequence[str] | None = None) -> int:
    (kind,) = sys.argv[1:] if argv is None else argv
    if kind not in PROBES:
        print(f"unknown probe {kind!r}; one of {sorted(PROBES)}", file=sys.stderr)
        return 2
    print(json.dumps(PROBES[kind](json.load(sys.stdin))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
