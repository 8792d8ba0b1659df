"""What the daemon tells of itself: the ``stats`` snapshot and its Prometheus text, how
long requests take, live traffic recorded to a trace, and a tenant's namespaces as an
operator sees them."""
