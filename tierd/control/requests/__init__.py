"""The requests a session answers, one module per kind: ``hello``, the stores and loads
(:mod:`~tierd.control.requests.block_requests`, with the connection's lease book,
:mod:`~tierd.control.requests.leases`), KV descriptions, namespaces, the operator's
requests and the event subscription; replies too big to build at once go out in pieces."""
