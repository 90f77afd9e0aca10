"""`kvpack serve` with a fault-injection point, for the SIGKILL and SIGTERM tests.

    KVPACK_TEST_PUBLISH_PAUSE='{"depth": 330, "at": "manifest_stored", "announce": "<file>"}' \
        python -m tests.kvpack.serve_child serve <kvpack serve flags>
    KVPACK_TEST_PUBLISH_DELAY='{"seconds": 2.0}' python -m tests.kvpack.serve_child serve ...

The real CLI and Service; the one difference is the vault's publish. PAUSE: when it
publishes the cut of exactly `depth` tokens and reaches the catalog.publish checkpoint
`at`, it writes `announce` and waits forever (until the parent SIGKILLs the process).
DELAY: every publish first waits `seconds` (a slow store), then runs unchanged. The hooks
live here, not in the product.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

from kvpack import cli, vault

PAUSE_ENV = "KVPACK_TEST_PUBLISH_PAUSE"
DELAY_ENV = "KVPACK_TEST_PUBLISH_DELAY"


def install_pause(spec: dict[str, Any]) -> None:
    real = vault.publish

    async def publish(**kwargs: Any):
        async def point(name: str) -> None:
            if name == spec["at"] and len(kwargs["tokens"]) == spec["depth"]:
                Path(spec["announce"]).write_text(f"{os.getpid()} {name}\n")
                await asyncio.Event().wait()  # until SIGKILL

        return await real(**kwargs, checkpoint=point)

    vault.publish = publish  # Vault.publish calls the module-level name


def install_delay(spec: dict[str, Any]) -> None:
    real = vault.publish

    async def publish(**kwargs: Any):
        await asyncio.sleep(spec["seconds"])
        return await real(**kwargs)

    vault.publish = publish


if __name__ == "__main__":
    if PAUSE_ENV in os.environ:
        install_pause(json.loads(os.environ[PAUSE_ENV]))
    if DELAY_ENV in os.environ:
        install_delay(json.loads(os.environ[DELAY_ENV]))
    sys.exit(cli.main(sys.argv[1:]))
