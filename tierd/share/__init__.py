"""What the package ships besides its code: the default config (``tierd.yaml``, the
chain ``tierd serve`` runs without ``-c``), the GPU node's (``gpu-node.yaml``), the
systemd unit (``tierd.service``), the example client (``client_demo.py``), the Grafana
dashboard of the daemon's metrics (``grafana-tierd.json``) and the status page the
metrics endpoint serves (``status.html``).

In a checkout these are links to ``config/`` and ``examples/`` (``status.html`` lives
here); a wheel carries the files.
"""

from pathlib import Path

__all__ = ["SHARE", "shipped"]

SHARE = Path(__file__).resolve().parent


def shipped(name: str) -> Path:
    """The path of a shipped file (``tierd.yaml``, ``gpu-node.yaml``, ...)."""
    path = SHARE / name
    if not path.is_file():
        raise FileNotFoundError(f"{name} is not shipped with this install of tierd ({SHARE})")
    return path
