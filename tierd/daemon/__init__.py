"""The composition root: ``tierd serve``'s process, from config to exit status.

:mod:`tierd.daemon.lifecycle` holds :class:`Daemon` (start-up, serving, shutdown, in the
order its docstring gives) and :func:`run_daemon`; :mod:`tierd.daemon.tenant_chains` opens each
tenant's chain and says who is which; :mod:`tierd.daemon.metrics_http` serves the
Prometheus endpoint and the status page (:mod:`tierd.daemon.status_page`), each asker shown
what its uid may see (:mod:`tierd.daemon.http_peer`: the uid from the kernel's TCP socket
table); :mod:`tierd.daemon.service` is what a service manager sees:
``sd_notify``, the pid file, the logs.
"""

from tierd.daemon.lifecycle import Daemon, run_daemon
from tierd.daemon.service import configure_logging, remove_pid_file, sd_notify, write_pid_file

__all__ = [
    "Daemon",
    "configure_logging",
    "remove_pid_file",
    "run_daemon",
    "sd_notify",
    "write_pid_file",
]
