"""The control socket: wire protocol, server, sessions and the client.

- :mod:`~tierd.control.protocol`: framing, error codes, request field checks;
- :mod:`~tierd.control.context`: what a server's sessions share (limits, pool, counters);
- :mod:`~tierd.control.session`: one client's requests (dispatch, namespace, lookups),
  with :mod:`~tierd.control.hello`, :mod:`~tierd.control.block_requests`,
  :mod:`~tierd.control.operator_requests` and :mod:`~tierd.control.leases` beside it;
- :mod:`~tierd.control.server`: the listening socket and the connections, each a
  :mod:`~tierd.control.connection`;
- :mod:`~tierd.control.stats`: the stats snapshot; :mod:`~tierd.control.prometheus`: its
  Prometheus rendering;
- :mod:`~tierd.control.client`: the async client engines and the CLI use, with
  :mod:`~tierd.control.handshake` (connecting, hello) and :mod:`~tierd.control.client_pool`
  (the pool mapping, the leases).

``docs/protocol.md`` documents every operation.
"""
