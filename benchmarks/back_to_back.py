"""Durable hits back to back against the same hits with a pause before each request.

    .venv/bin/python benchmarks/back_to_back.py [--s3] [--prompts 8] [--pauses 0,0.3]
        [--model smollm2] [--depth 256] [--rounds 2]

A fresh `kvpack serve --measure-restores` publishes `prompts` distinct prompts of
`depth` tokens (cold), then, for each pause in turn and `rounds` times over, a
restarted server on the same vault serves them again, one after the other, sleeping
`pause` seconds before each request: every one a durable hit. Printed per run: the
server's own restore seconds of the first hit (right after the warm start) and the
median of the rest, and the CPU seconds the server's busiest threads used between one
response and the next request. A local directory + SQLite by default; with --s3, a
SeaweedFS started here (catalog on SQLite). What a request leaves running (threads
that spin, queued jobs) shows as restores slower back to back than after a pause.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from cas.s3 import S3Config, ensure_bucket
from engine.models import load_model
from kvpack.bench.seaweedfs import start_seaweedfs
from kvpack.bench.serve import ServerProcess, prompt_tokens, run_leg


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--s3", action="store_true", help="a local SeaweedFS, not a directory")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--pauses", default="0,0.3", help="seconds before each request")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--depth", type=int, default=256)
    p.add_argument("--rounds", type=int, default=2, help="restarted servers per pause")
    opts = p.parse_args()
    loaded = load_model(opts.model)
    prompts = [prompt_tokens(loaded.tokenizer, opts.depth, seed=100 + i, title=f"b2b {i}")
               for i in range(opts.prompts)]  # fmt: skip
    pauses = [float(x) for x in opts.pauses.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        argv = [sys.executable, "-m", "kvpack.cli", "serve", "--host", "127.0.0.1", "--port",
                "0", "--no-auth", "--measure-restores", "--model", opts.model,
                "--data-dir", str(Path(tmp) / "data")]  # fmt: skip
        if not opts.s3:
            return run(argv, Path(tmp), loaded.name, prompts, pauses, opts.rounds)
        with start_seaweedfs(Path(tmp) / "s3") as server:
            os.environ.update(server.s3.env())  # the servers started below inherit it
            ensure_bucket(S3Config.from_env("back-to-back"))
            argv += ["--store-url", "s3://back-to-back/vault"]
            return run(argv, Path(tmp), loaded.name, prompts, pauses, opts.rounds)


def run(
    argv: list[str],
    tmp: Path,
    model: str,
    prompts: Sequence[list[int]],
    pauses: Sequence[float],
    rounds: int,
) -> None:
    leg = {"model": model, "max_tokens": 4, "timeout_s": 300.0}
    with ServerProcess(argv, tmp / "cold.log", 300) as server:
        for i, tokens in enumerate(prompts):
            run_leg(server.url, f"cold {i}", tokens, **leg)
    for pause in [p for _ in range(rounds) for p in pauses]:
        with ServerProcess(argv, tmp / "restarted.log", 300) as server:
            assert server.proc is not None
            pid, restores, between = server.proc.pid, [], Counter[str]()
            after = thread_cpu(pid)
            for i, tokens in enumerate(prompts):
                time.sleep(pause)
                before = thread_cpu(pid)
                between.update({t: s - after.get(t, 0.0) for t, s in before.items()})
                done = run_leg(server.url, f"durable {i}", tokens, **leg)
                after = thread_cpu(pid)
                (record,) = done["server_restores"]
                restores.append(record["seconds"] * 1000)
        busiest = ", ".join(f"{t} {s:.2f}" for t, s in between.most_common(2))
        print(f"pause {pause:.2f} s: first {restores[0]:.1f} ms, the rest median "
              f"{statistics.median(restores[1:]):.1f} ms "
              f"[{' '.join(f'{r:.0f}' for r in restores[1:])}]; CPU s between requests: "
              f"{busiest}", flush=True)  # fmt: skip


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of each of the process's threads, by thread id less
    the pid (pid+1: the first thread it started, OpenBLAS's worker, loaded at import)."""
    out = {}
    tick = os.sysconf("SC_CLK_TCK")
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        out[f"thread pid+{int(task.name) - pid}"] = (int(fields[11]) + int(fields[12])) / tick
    return out


if __name__ == "__main__":
    main()
