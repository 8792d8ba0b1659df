"""The control socket: wire protocol, server, sessions and the client.

- :mod:`~tierd.control.protocol`: framing, error codes, request field checks;
- :mod:`~tierd.control.context`: what a server's sessions share (limits, pool, counters);
- :mod:`~tierd.control.session`: one client's requests, namespace and leases;
- :mod:`~tierd.control.server`: the listening socket and the connections;
- :mod:`~tierd.control.stats`: the stats snapshot and its Prometheus rendering;
- :mod:`~tierd.control.client`: the async client engines and the CLI use.

``docs/protocol.md`` documents every operation.
"""
