"""``tierd.client``: the async client of the daemon's control socket.

See :mod:`tierd.control.clients.client` for the full story; this module is the stable import
path for engines::

    from tierd.client import Client

It re-exports exactly :mod:`tierd.control.clients.client`'s public names (its ``__all__``), so a
name added there is importable here too.
"""

from tierd.control.clients.client import *  # noqa: F403
from tierd.control.clients.client import __all__ as __all__
