"""The engine thread's scheduler (kvpack/service/scheduler.py) with plain generators as
tasks: turns rotate between tenants one step at a time, a tenant's tasks run in order,
the per-tenant bound refuses with a retry estimate, and failures reach their callers."""

from __future__ import annotations

import threading

import pytest

from kvpack.service.scheduler import Scheduler, SchedulerClosed, TenantBusy
from tests.engine.test_streams import released_on


class Log:
    """Tasks that record each step they take, and their outcomes, in one order."""

    def __init__(self) -> None:
        self.steps: list[str] = []
        self.outcomes: dict[str, tuple[object, BaseException | None]] = {}
        self.finished = threading.Event()
        self.expected = 0

    def task(self, name: str, n: int, gate: threading.Event | None = None):
        def start():
            def steps():
                for i in range(n):
                    if gate is not None and i == 0:
                        assert gate.wait(30)
                    self.steps.append(name)
                    yield "step"
                return f"{name} done"

            return steps()

        def done(value, error):
            self.outcomes[name] = (value, error)
            if len(self.outcomes) == self.expected:
                self.finished.set()

        return start, done


@pytest.fixture
def scheduler():
    s = Scheduler(max_queued=8)
    yield s
    s.close()


def test_a_short_task_of_one_tenant_interleaves_with_another_tenants_long_ones(scheduler):
    """Six 10-step tasks of A are queued (the first one held at its first step), then one
    2-step task of B: B's steps alternate with A's and B finishes after 3 of A's steps,
    long before A's first task; A's tasks run one after another, in order."""
    log, gate = Log(), threading.Event()
    log.expected = 7
    for i in range(6):
        scheduler.submit("a", *log.task(f"a{i}", 10, gate if i == 0 else None))
    scheduler.submit("b", *log.task("b", 2))
    assert scheduler.pending("a") == 6 and scheduler.pending("b") == 1
    gate.set()
    assert log.finished.wait(30)
    assert log.steps[:5] == ["a0", "b", "a0", "b", "a0"]
    a_steps = [s for s in log.steps if s != "b"]
    assert a_steps == [f"a{i}" for i in range(6) for _ in range(10)]
    assert log.outcomes["b"] == ("b done", None) and scheduler.pending() == 0


def test_past_the_bound_a_tenant_is_refused_with_a_retry_estimate(scheduler):
    """Branch: the 9th task of a tenant with 8 running or waiting is refused (TenantBusy,
    retry_after_s >= 1); another tenant is not; once they ran, the tenant is taken again."""
    log, gate = Log(), threading.Event()
    log.expected = 9
    for i in range(8):
        scheduler.submit("a", *log.task(f"a{i}", 1, gate if i == 0 else None))
    with pytest.raises(TenantBusy) as busy:
        scheduler.submit("a", *log.task("a8", 1))
    assert (busy.value.namespace, busy.value.queued) == ("a", 8)
    assert 1 <= busy.value.retry_after_s <= 60
    scheduler.submit("b", *log.task("b", 1))
    gate.set()
    assert log.finished.wait(30)
    log.finished.clear()
    log.expected = 10
    scheduler.submit("a", *log.task("again", 1))
    assert log.finished.wait(30) and log.outcomes["again"] == ("again done", None)


def test_a_failing_task_reports_its_error_and_the_thread_goes_on(scheduler, caplog):
    """Branches: raising when created, raising mid-way, a done callback that raises: each
    error reaches its task's callback, the callback's own error is logged; the next task
    still runs."""
    outcomes = {}
    finished = threading.Event()

    def record(name):
        def done(value, error):
            outcomes[name] = (value, error)
            if name == "last":
                finished.set()
            if name == "bad callback":
                raise RuntimeError("callback")

        return done

    def broken_start():
        raise ValueError("at start")

    def midway():
        yield "step"
        raise KeyError("midway")

    scheduler.submit("a", broken_start, record("start"))
    scheduler.submit("a", midway, record("midway"))
    scheduler.submit("a", lambda: iter(()), record("bad callback"))
    scheduler.submit("b", lambda: iter(()), record("last"))
    assert finished.wait(30)
    assert isinstance(outcomes["start"][1], ValueError)
    assert isinstance(outcomes["midway"][1], KeyError)
    assert set(outcomes) == {"start", "midway", "bad callback", "last"}
    assert scheduler.close(30)  # "last" may end first: the log is written by now
    logged = [r for r in caplog.records if r.getMessage() == "a task's done callback failed"]
    assert len(logged) == 1 and logged[0].exc_info[1].args == ("callback",)


def test_close_runs_what_was_queued_then_refuses():
    scheduler = Scheduler(max_queued=4)
    log = Log()
    log.expected = 3
    for name in ("a", "b", "c"):
        scheduler.submit(name, *log.task(name, 3))
    assert scheduler.close(30)
    assert set(log.outcomes) == {"a", "b", "c"} and len(log.steps) == 9
    with pytest.raises(SchedulerClosed):
        scheduler.submit("a", *log.task("late", 1))


def test_the_engine_thread_releases_its_mlx_streams_as_it_ends(monkeypatch):
    """The engine thread runs MLX work; its last act is to release its streams (MLX 0.32
    can abort the process at exit otherwise: engine/streams.py)."""
    released = released_on(monkeypatch)
    scheduler = Scheduler(max_queued=4, name="engine-under-test")
    log = Log()
    log.expected = 1
    scheduler.submit("a", *log.task("a", 2))
    assert log.finished.wait(30) and released == []
    assert scheduler.close(30)
    assert released == ["engine-under-test"]


def test_call_runs_a_function_on_the_engine_thread_and_returns_what_it_did(scheduler):
    """call: the function runs on the scheduler's thread, not the caller's; its value
    comes back, and what it raised is raised in the caller; a call from the engine
    thread itself is refused instead of waiting forever."""
    assert scheduler.call(threading.current_thread) is scheduler._thread
    assert scheduler.call(lambda: 42) == 42

    def fails():
        raise ValueError("warm failed")

    with pytest.raises(ValueError, match="warm failed"):
        scheduler.call(fails)
    with pytest.raises(RuntimeError, match="wait for itself"):  # not a deadlock
        scheduler.call(lambda: scheduler.call(lambda: 1))
    assert scheduler.pending() == 0
