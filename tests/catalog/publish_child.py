"""A publisher process for the crash test: publishes one cut and, at a named
checkpoint, prints PAUSED and waits forever, to be SIGKILLed by the parent.

    python -m tests.catalog.publish_child '<json spec>'
"""

from __future__ import annotations

import asyncio
import json
import sys

from cas.chunks import ChunkStore
from cas.keys import Keyring
from cas.local import LocalDirStore
from cas.s3 import S3Config, S3Store
from catalog.db import make_engine
from tests.catalog.helpers import do_publish


async def main(spec: dict) -> None:
    if spec["store"]["kind"] == "local":
        objects = LocalDirStore(spec["store"]["root"])
    else:
        objects = S3Store(S3Config(**spec["store"]["config"]))
    store = ChunkStore(objects, Keyring.from_json(spec["keyring"]), namespace="test")
    engine = make_engine(spec["db_url"])

    async def point(name: str) -> None:
        if name == spec["pause_at"]:
            print("PAUSED", flush=True)
            await asyncio.Event().wait()  # until SIGKILL

    planes = [(role, bytes.fromhex(data)) for role, data in spec["planes"]]
    await do_publish(store, engine, spec["tokens"], planes, checkpoint=point)
    print("COMPLETED", flush=True)


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
