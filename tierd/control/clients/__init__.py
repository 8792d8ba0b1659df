"""The clients' side of the control socket: the async client
(:mod:`~tierd.control.clients.client`, with its asyncio protocol and operator requests)
and the blocking client of engines' threads
(:mod:`~tierd.control.clients.blocking_client`), which differ only in how they wait. They
share one core: the codec (:mod:`tierd.control.protocol`), one way in
(:mod:`~tierd.control.clients.handshake`: the socket, the peer check, hello, how an error
reply reads), one request layer (:mod:`~tierd.control.clients.requests`: a call cut into
the requests the daemon takes, their replies read), one pool mapping and its leases
(:mod:`~tierd.control.clients.pool`) and one region request layer
(:mod:`~tierd.control.clients.regions`)."""
