"""The circuit breaker (cas/breaker.py) on a fake clock: when it opens, what it refuses,
how the probe closes or reopens it."""

from __future__ import annotations

import pytest

from cas.breaker import Admission, Breaker


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def test_threshold_failures_in_a_row_open_it_and_a_success_resets_the_count(clock):
    b = Breaker("s3", threshold=3, backoff_s=5, clock=clock)
    b.failure(), b.failure(), b.success(), b.failure(), b.failure()
    assert b.allow() and b.state().state == "closed"
    b.failure()
    assert not b.allow() and not b.allow()
    state = b.state()
    assert (state.state, state.failures, state.retry_in_s, state.skipped) == ("open", 3, 5, 2)
    assert not state.up


def test_after_the_window_one_probe_goes_and_its_success_closes(clock):
    b = Breaker("s3", threshold=1, backoff_s=5, clock=clock)
    b.failure()
    clock.now += 5
    assert b.state().state == "half-open"
    assert b.admit() is Admission.PROBE  # the probe, told so
    assert not b.allow()  # everyone else waits for its answer
    assert b.admit() is Admission.REFUSED
    b.success()
    assert b.allow() and b.state().up and b.admit() is Admission.CALL


def test_a_failed_probe_reopens_with_a_doubled_window_up_to_the_cap(clock):
    b = Breaker("s3", threshold=1, backoff_s=5, max_backoff_s=12, clock=clock)
    b.failure()
    windows = []
    for _ in range(3):
        clock.now += 100
        assert b.allow()
        b.failure()
        windows.append(b.state().retry_in_s)
    assert windows == [10, 12, 12]
    clock.now += 100
    assert b.allow()
    b.success()
    b.failure()  # closed again, the window back at its start
    assert b.state().retry_in_s == 5


def test_stragglers_failing_after_it_opened_do_not_extend_the_window(clock):
    b = Breaker("s3", threshold=1, backoff_s=5, clock=clock)
    b.failure()
    clock.now += 4
    b.failure(), b.failure()  # calls that were in flight when it opened
    assert b.state().retry_in_s == pytest.approx(1)


def test_a_probe_that_never_reports_is_replaced_after_another_window(clock):
    b = Breaker("s3", threshold=1, backoff_s=5, clock=clock)
    b.failure()
    clock.now += 5
    assert b.allow()  # a probe whose caller was cancelled: it never reports
    clock.now += 4.9
    assert not b.allow()
    clock.now += 0.2
    assert b.allow()


@pytest.mark.parametrize(
    "kw", [{"threshold": 0}, {"backoff_s": 0}, {"backoff_s": 10, "max_backoff_s": 5},
           {"max_backoff_s": float("inf")}, {"backoff_s": float("nan")}],
)  # fmt: skip
def test_bad_settings_are_refused(kw):
    with pytest.raises(ValueError, match="breaker"):
        Breaker("x", **kw)
