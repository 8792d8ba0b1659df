"""What every session of one server shares: the context
(:mod:`~tierd.control.state.context`: tenants, limits, counters, figures), the tenants
at run time (:mod:`~tierd.control.state.tenant_table`: who is which, and where a
tenant's lease quota is enforced), the leases the daemon ends on its own, and the
threads that copy engine-region jobs, shared fairly between tenants."""
