"""A deadline on every wait for PostgreSQL (catalog/db.py installs it).

- deadline: how long one wait for the server may last (a query's results, a commit, a
  pre-ping). psycopg waits forever by default: a server that stops answering, or a
  network path that silently drops traffic, never ends a wait, and the server-side
  statement_timeout cannot fire for a statement the server never received.
- expiry: DeadlinePassed (a psycopg OperationalError); the connection is closed first
  (it is mid-statement and unusable), so SQLAlchemy sees it broken and the pool drops it,
  and `on_expiry` is told (catalog/db.py then holds off reconnecting for a while, and
  does not retry the call: the server did not answer, it did not just drop a socket).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psycopg
from psycopg import pq


class DeadlinePassed(psycopg.OperationalError):
    """A wait for the server outlasted its deadline; the connection was closed."""


class DeadlineConnection(psycopg.Connection):
    deadline_s: float | None = None
    on_expiry: Callable[[], None] | None = None

    @classmethod
    def open(
        cls, deadline_s: float, on_expiry: Callable[[], None], *args: Any, **kwargs: Any
    ) -> DeadlineConnection:
        conn = cls.connect(*args, **kwargs)
        conn.deadline_s, conn.on_expiry = deadline_s, on_expiry
        return conn

    def wait(self, gen: Any, interval: float = 0.1, timeout: float | None = None) -> Any:
        try:
            return super().wait(gen, interval, timeout if timeout is not None else self.deadline_s)
        except psycopg.OperationalError as e:
            if self.pgconn.transaction_status == pq.TransactionStatus.ACTIVE:
                self.pgconn.finish()  # still waiting on the server: nothing can reuse it
                if self.on_expiry is not None:
                    self.on_expiry()
                raise DeadlinePassed(str(e)) from e
            raise
