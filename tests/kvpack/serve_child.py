"""`kvpack serve` with a fault-injection point, for the SIGKILL test.

    KVPACK_TEST_PUBLISH_PAUSE='{"depth": 330, "at": "manifest_stored", "announce": "<file>"}' \
        python -m tests.kvpack.serve_child serve <kvpack serve flags>

The real CLI and Service; the one difference is the vault's publish: when it
publishes the cut of exactly `depth` tokens and reaches the catalog.publish checkpoint
`at`, it writes `announce` and waits forever (until the parent SIGKILLs the process).
Every other publish runs unchanged. The hook lives here, not in the product.
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


def install(spec: dict[str, Any]) -> None:
    real = vault.publish

    async def publish(**kwargs: Any):
        async def point(name: str) -> None:
            if name == spec["at"] and len(kwargs["tokens"]) == spec["depth"]:
                Path(spec["announce"]).write_text(f"{os.getpid()} {name}\n")
                await asyncio.Event().wait()  # until SIGKILL

        return await real(**kwargs, checkpoint=point)

    vault.publish = publish  # Vault.publish calls the module-level name


if __name__ == "__main__":
    install(json.loads(os.environ[PAUSE_ENV]))
    sys.exit(cli.main(sys.argv[1:]))
