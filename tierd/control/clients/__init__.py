"""The clients' side of the control socket: the async client
(:mod:`~tierd.control.clients.client`, with its asyncio protocol and operator requests)
and the blocking client of engines' threads
(:mod:`~tierd.control.clients.blocking_client`), over one way in
(:mod:`~tierd.control.clients.handshake`), one pool mapping and its leases
(:mod:`~tierd.control.clients.pool`) and one region request layer."""
