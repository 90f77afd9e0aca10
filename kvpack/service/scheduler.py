"""The engine thread: every request's steps, round-robin between tenants.

- task: one request as a generator of engine steps (Service.steps), created on the
  engine thread when the task first runs; its outcome (the generator's return value, or
  what it raised) goes to its `done` callback, on the engine thread.
- turn: the thread takes the next tenant with work, in rotation, and advances that
  tenant's oldest task by exactly one step (one aligned prefill step, one decoded
  token, or the ladder's lookup). A tenant's own tasks run one after another, in arrival
  order (they share the tenant's slots); different tenants' tasks interleave, so one
  tenant's long prompts cannot starve another's short one.
- bound: at most `max_queued` tasks per tenant, running or waiting; beyond it `submit`
  raises TenantBusy, with a retry-after estimate from how long recent tasks took.
- call: a plain function run on the engine thread as a task of its own, the caller
  waiting for its value (the server's warm start: MLX streams belong to the thread that
  made them, engine/streams.py, so what warms the engine must run where requests will).

MLX and the slots are used from this thread only.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Generator
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any, TypeVar

from engine import streams

log = logging.getLogger(__name__)
DEFAULT_MAX_QUEUED = 32
MAX_RETRY_AFTER_S = 60
Done = Callable[[Any, BaseException | None], None]
T = TypeVar("T")
CALLS = "\0engine"  # the queue `call` uses: no tenant can be named this (NUL)


class TenantBusy(Exception):
    """A tenant already has `queued` tasks (the bound); try again in `retry_after_s`."""

    def __init__(self, namespace: str, queued: int, retry_after_s: int) -> None:
        super().__init__(
            f"tenant {namespace!r} has {queued} requests queued or running, its limit; "
            f"retry in {retry_after_s} s"
        )
        self.namespace, self.queued, self.retry_after_s = namespace, queued, retry_after_s


class SchedulerClosed(Exception):
    """The scheduler is shutting down and takes no new tasks."""


@dataclass
class Task:
    namespace: str
    start: Callable[[], Generator[Any, None, Any]]
    done: Done
    steps: Generator[Any, None, Any] | None = None
    started_at: float = field(default=0.0)


class Scheduler:
    def __init__(self, *, max_queued: int = DEFAULT_MAX_QUEUED, name: str = "kvpack-engine"):
        if max_queued < 1:
            raise ValueError(f"max_queued must be >= 1, got {max_queued!r}")
        self.max_queued = max_queued
        self.steps_run = 0  # every step of every task, since start
        self._queues: dict[str, deque[Task]] = {}
        self._turns: deque[str] = deque()  # tenants with work, next first
        self._cond = threading.Condition()
        self._closing = False
        self._mean_task_s = 1.0  # a running mean of task durations (for Retry-After)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(
        self, namespace: str, start: Callable[[], Generator[Any, None, Any]], done: Done
    ) -> None:
        """Queue a task for `namespace`; TenantBusy past the bound, SchedulerClosed after
        close()."""
        with self._cond:
            if self._closing:
                raise SchedulerClosed("the engine is shutting down")
            queue = self._queues.get(namespace)
            if queue is not None and len(queue) >= self.max_queued:
                raise TenantBusy(namespace, len(queue), self._retry_after())
            if queue is None:
                queue = self._queues[namespace] = deque()
                self._turns.append(namespace)
            queue.append(Task(namespace, start, done))
            self._cond.notify_all()

    def call(self, fn: Callable[[], T]) -> T:
        """fn() on the engine thread, in its turn; its value, or what it raised. Blocks
        until it has run; RuntimeError from the engine thread, which would wait for itself."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("Scheduler.call from the engine thread would wait for itself")
        result: futures.Future[T] = futures.Future()

        def steps() -> Generator[None, None, T]:
            yield from ()  # a generator: fn runs at its first step, on the engine thread
            return fn()

        def done(value: Any, error: BaseException | None) -> None:
            if error is None:
                result.set_result(value)
            else:
                result.set_exception(error)

        self.submit(CALLS, steps, done)
        return result.result()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def pending(self, namespace: str | None = None) -> int:
        """Tasks running or waiting (of one tenant, or of all)."""
        with self._cond:
            if namespace is not None:
                return len(self._queues.get(namespace, ()))
            return sum(len(q) for q in self._queues.values())

    def close(self, timeout: float | None = 30.0) -> bool:
        """Take no more tasks; the thread finishes the queued ones (cancel them first for a
        quick stop) and ends. True if it ended within `timeout`."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _retry_after(self) -> int:
        return max(1, min(MAX_RETRY_AFTER_S, math.ceil(self._mean_task_s)))

    def _run(self) -> None:
        try:
            self._serve()
        finally:
            streams.release()

    def _serve(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._turns or self._closing)
                if not self._turns:
                    return
                namespace = self._turns[0]
                task = self._queues[namespace][0]
            finished, value, error = self._advance(task)
            with self._cond:
                # Its turn is over: to the back, behind any tenant that arrived meanwhile.
                self._turns.remove(namespace)
                queue = self._queues[namespace]
                if finished:
                    queue.popleft()
                    seconds = time.perf_counter() - task.started_at
                    self._mean_task_s = 0.8 * self._mean_task_s + 0.2 * seconds
                if queue:
                    self._turns.append(namespace)
                else:
                    del self._queues[namespace]
            if finished:
                try:
                    task.done(value, error)
                except Exception:  # noqa: BLE001 - a callback never stops the engine thread
                    log.exception("a task's done callback failed")

    def _advance(self, task: Task) -> tuple[bool, Any, BaseException | None]:
        """One step of `task`: (finished, its value, what it raised)."""
        self.steps_run += 1
        try:
            if task.steps is None:
                task.started_at = time.perf_counter()
                task.steps = task.start()
            next(task.steps)
        except StopIteration as stop:
            return True, stop.value, None
        except BaseException as e:  # noqa: BLE001 - every failure reaches its caller
            return True, None, e
        return False, None, None
