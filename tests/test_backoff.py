"""The one backoff of connection attempts (tierd.breaker.Backoff), on a clock of its own."""

from __future__ import annotations

from tierd.breaker import Backoff


def test_waits_double_up_to_the_ceiling_and_a_success_starts_them_again() -> None:
    now = [0.0]
    backoff = Backoff(3.0, first_s=1.0, clock=lambda: now[0])
    assert backoff.due()
    waits = []
    for _ in range(4):
        backoff.failed()
        start = now[0]
        while not backoff.due():
            now[0] += 0.5
        waits.append(now[0] - start)
    assert waits == [1.0, 2.0, 3.0, 3.0]
    backoff.succeeded()
    backoff.failed()
    assert not backoff.due()
    now[0] += 1.0
    assert backoff.due()


def test_an_answer_since_the_failed_attempt_makes_the_next_one_due_at_once() -> None:
    """Another connection heard the server after ours failed: it is back, try now (a
    stopped daemon resumed; the breaker's probe was answered)."""
    now = [10.0]
    backoff = Backoff(10.0, first_s=5.0, clock=lambda: now[0])
    backoff.failed()
    assert not backoff.due(answered_at=9.0)  # an answer before the failure says nothing
    assert backoff.due(answered_at=10.5)
    backoff.hold_off()  # answered, but cannot serve us: answers do not shorten this
    assert not backoff.due(answered_at=11.0)
    now[0] += 10.0
    assert backoff.due()
    backoff.failed()
    backoff.at_once()  # lost, not refused
    assert backoff.due()
