"""Workloads: request traces (Mooncake format), a synthetic trace generator, and replaying
a trace through a tier to measure its hit ratio and bookkeeping throughput."""

from tierd.workload.simulate import SimulationResult, parse_capacity, replay, simulate
from tierd.workload.trace import (
    Trace,
    TraceRecord,
    TraceRequest,
    parse_trace,
    read_trace,
    write_trace,
)

__all__ = [
    "SimulationResult",
    "Trace",
    "TraceRecord",
    "TraceRequest",
    "parse_capacity",
    "parse_trace",
    "read_trace",
    "replay",
    "simulate",
    "write_trace",
]
