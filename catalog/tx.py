"""Transactions for the async paths (publish, GC) and their test pause points.

- run_tx: one transaction in a worker thread, so it never spans an await; a Session the
  caller passes runs inline, inside the caller's own transaction.
- with_session: a query (which takes its session by keyword) bound to its other
  arguments, as the one-argument function run_tx runs.
- checkpoint: an awaitable called with a step name ("chunks_stored", ...), where tests
  pause or kill a publisher or collector to force an interleaving.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from sqlalchemy import Engine
from sqlalchemy.orm import Session

T = TypeVar("T")
Checkpoint = Callable[[str], Awaitable[None]]


async def run_tx(db: Engine | Session, fn: Callable[[Session], T]) -> T:
    if isinstance(db, Session):
        return fn(db)

    def work() -> T:
        with Session(db, expire_on_commit=False) as session, session.begin():
            return fn(session)

    return await asyncio.to_thread(work)


def with_session(query: Callable[..., T], **arguments: Any) -> Callable[[Session], T]:
    return lambda session: query(session=session, **arguments)


async def no_checkpoint(_: str) -> None:
    return None
