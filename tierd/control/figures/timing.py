"""How long requests take: latency histograms, and one debug line per request.

A :class:`RequestTiming` belongs to one server. The session calls :meth:`observe` once
per answered request with the request's arrival time: it adds the time from arrival to
reply to ``tierd_request_duration_seconds{op}`` and, for a load that returned blocks, to
``tierd_load_duration_seconds{medium}`` (the slowest medium the load read from: a load
that promoted blocks from disk counts under DISK). That is one clock read, a binary
search over the bucket bounds and two additions per histogram; no per-key work, no lock
(everything runs on the event loop's thread). prometheus-client's ``Histogram`` does the
same with a lock per counter and a linear bucket scan, several times slower per request;
these are rendered through its ``HistogramMetricFamily``, so the exposition is the same.

Per-request debug lines (connection id, op, number of keys, the first key's first bytes
in hex, duration in microseconds, result code) are written only when the ``tierd.control``
logger writes debug lines: that is checked once, when the timing is made (and again by
:meth:`refresh_log_level`), not for every request.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from tierd.logs import debug_enabled, get_logger

__all__ = ["LATENCY_BUCKETS", "LatencyHistogram", "RequestTiming"]

log = get_logger("tierd.control")

# 10 µs .. 10 s: a lookup answered from memory takes tens of microseconds, a load that
# promotes from a busy disk can take seconds.
LATENCY_BUCKETS = (
    0.00001,
    0.000025,
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
_BOUNDS_NS = tuple(round(bound * 1e9) for bound in LATENCY_BUCKETS)
_KEY_PREFIX_BYTES = 8  # of the first key, in debug lines


class LatencyHistogram:
    """Durations in nanoseconds, counted per bucket of :data:`LATENCY_BUCKETS` (the last
    count is above every bound); not thread-safe: one event loop observes and renders."""

    __slots__ = ("counts", "sum_ns")

    def __init__(self) -> None:
        self.counts = [0] * (len(_BOUNDS_NS) + 1)
        self.sum_ns = 0

    def observe_ns(self, elapsed_ns: int) -> None:
        self.counts[bisect_left(_BOUNDS_NS, elapsed_ns)] += 1  # bucket: elapsed <= bound
        self.sum_ns += elapsed_ns

    def buckets(self) -> list[tuple[str, float]]:
        """Cumulative ``(le, count)`` pairs, ``+Inf`` last, as the exposition wants."""
        out: list[tuple[str, float]] = []
        total = 0
        for bound, count in zip((*map(str, LATENCY_BUCKETS), "+Inf"), self.counts, strict=True):
            total += count
            out.append((bound, total))
        return out


class RequestTiming:
    """One server's request latency histograms (``collectors()`` for the exposition)."""

    def __init__(self, *, debug: bool | None = None) -> None:
        self.by_op: dict[str, LatencyHistogram] = {}
        self.by_medium: dict[str, LatencyHistogram] = {}
        self.debug = debug_enabled(log) if debug is None else debug

    def refresh_log_level(self) -> None:
        """Check again whether debug lines are written (after logging was reconfigured)."""
        self.debug = debug_enabled(log)

    def collectors(self) -> list[Collector]:
        return [_Histograms(self)]

    def observe(
        self,
        conn: int,
        op: str,
        msg: dict[str, Any],
        started_ns: int,
        result: str,
        medium: str | None = None,
    ) -> None:
        """Record one answered request; ``op`` must be a known operation (the label set
        stays bounded), ``medium`` the slowest medium of a load that returned blocks."""
        elapsed_ns = time.perf_counter_ns() - started_ns
        histogram = self.by_op.get(op)
        if histogram is None:
            histogram = self.by_op[op] = LatencyHistogram()
        histogram.observe_ns(elapsed_ns)
        if medium is not None:
            histogram = self.by_medium.get(medium)
            if histogram is None:
                histogram = self.by_medium[medium] = LatencyHistogram()
            histogram.observe_ns(elapsed_ns)
        if self.debug:
            self._log(conn, op, msg, elapsed_ns / 1e9, result, medium)

    def _log(
        self,
        conn: int,
        op: str,
        msg: dict[str, Any],
        elapsed_s: float,
        result: str,
        medium: str | None,
    ) -> None:
        keys = msg.get("keys")
        if not isinstance(keys, list):
            keys = []
        count = len(keys)
        first = keys[0] if count and isinstance(keys[0], bytes) else b""
        fields: dict[str, Any] = {
            "conn": conn,
            "op": op,
            "keys": count,
            "key": first[:_KEY_PREFIX_BYTES].hex(),
            "us": round(elapsed_s * 1e6, 1),
            "result": result,
        }
        if medium is not None:
            fields["medium"] = medium
        log.debug("request", **fields)


class _Histograms(Collector):
    """The two families of a :class:`RequestTiming`, as prometheus-client metrics."""

    def __init__(self, timing: RequestTiming) -> None:
        self._timing = timing

    def collect(self) -> Iterator[Metric]:
        yield _family(
            "tierd_request_duration_seconds",
            "Time from a request's arrival to its reply, per protocol operation",
            "op",
            self._timing.by_op,
        )
        yield _family(
            "tierd_load_duration_seconds",
            "Time from a load's arrival (prepare_load, get) to its reply, per slowest"
            " medium its blocks were read from",
            "medium",
            self._timing.by_medium,
        )


def _family(
    name: str, text: str, label: str, histograms: dict[str, LatencyHistogram]
) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, text, labels=[label])
    for value, histogram in sorted(histograms.items()):
        family.add_metric([value], histogram.buckets(), histogram.sum_ns / 1e9)
    return family
