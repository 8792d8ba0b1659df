"""Ask a KV-event publisher's replay socket for what it keeps (docs/events.md): the one
replay client of the tests, benchmarks and anyone checking a daemon's events."""

from __future__ import annotations

__all__ = ["kv_replay"]

_END = (-1).to_bytes(8, "big", signed=True)


def kv_replay(
    endpoint: str, start: int = 0, *, timeout_ms: int = 5000, limit: int = 100_000
) -> list[tuple[bytes, int, bytes]]:
    """Every batch the ROUTER at ``endpoint`` keeps from sequence ``start`` on, as
    ``(topic, sequence, payload)``; at most ``limit`` (then AssertionError), each waited
    for at most ``timeout_ms`` (zmq.Again past it)."""
    import zmq

    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
    try:
        sock.connect(endpoint)
        sock.send_multipart([b"", start.to_bytes(8, "big")])
        out: list[tuple[bytes, int, bytes]] = []
        for _ in range(limit):
            _, topic, seq, payload = sock.recv_multipart()
            if seq == _END:
                return out
            out.append((topic, int.from_bytes(seq, "big"), payload))
        raise AssertionError(f"no end marker within {limit} batches")
    finally:
        sock.close()
