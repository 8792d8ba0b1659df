"""What every engine integration shares (no engine imports): the daemon watched and
reached (:mod:`~tierd.integrations.core.link`: a connection on a thread and loop of its
own, the breaker's probe, bounded asks; :mod:`~tierd.integrations.core.channel`: each
calling thread's own blocking connection), every engine call, one way
(:mod:`~tierd.integrations.core.engine_calls`, down the data path
:mod:`~tierd.integrations.core.route` picks, :mod:`~tierd.integrations.core.data_paths`),
leases on the daemon's pool for engines that copy themselves
(:mod:`~tierd.integrations.core.pool_leases`), namespaces from what makes KV bytes
interchangeable (:mod:`~tierd.integrations.core.naming`), the checks of an engine's
settings (:mod:`~tierd.integrations.core.params`), the node's blocks from the daemon's
events (:mod:`~tierd.integrations.core.residency`,
:mod:`~tierd.integrations.core.node_events`), what ``TIERD`` means
(:mod:`~tierd.integrations.core.one_flag`) and log lines through the standard logging
every engine configures (:mod:`~tierd.integrations.core.engine_log`)."""
