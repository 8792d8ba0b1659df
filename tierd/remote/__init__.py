"""The shared remote level: blocks kept on a Redis-protocol server (Redis, Valkey, or a
cluster of either) that every node's daemon reads and writes.

Importing this package loads no client library: :mod:`tierd.remote.redis_level` does
(through :mod:`tierd.remote.calls`), when a chain with a remote level opens.
"""

from tierd.breaker import CircuitBreaker
from tierd.remote.values import HEADER_BYTES, decode_block, encode_block

__all__ = ["HEADER_BYTES", "CircuitBreaker", "decode_block", "encode_block"]
