"""The control socket: its wire protocol, the daemon's side of it, and the clients' side.

- :mod:`~tierd.control.protocol`: framing, error codes, request field checks (both sides);
  :mod:`~tierd.control.socketfile`: the socket file and who is at the other end.
- :mod:`~tierd.control.serving`: the daemon's socket side: the listener, each
  connection's frames in and replies out, its guards, and its session (the dispatch).
- :mod:`~tierd.control.requests`: the requests a session answers, one module per kind
  (hello, stores and loads with the connection's lease book, KV descriptions,
  namespaces, operator requests, the event subscription).
- :mod:`~tierd.control.engine_regions`: an engine's own memory handed to the daemon
  (``register_region``, ``region_store``, ``region_load``).
- :mod:`~tierd.control.state`: what every session shares: the context, the tenants at run
  time (who is which; lease quotas), the leases the daemon ends, the region copy threads.
- :mod:`~tierd.control.figures`: what the daemon tells of itself: the stats snapshot,
  its Prometheus text, request timing, live-traffic recording, namespace figures.
- :mod:`~tierd.control.clients`: the async client engines and the CLI use and the
  blocking client of engines' threads, over one handshake, pool mapping and region layer.

``docs/protocol.md`` documents every operation.
"""
