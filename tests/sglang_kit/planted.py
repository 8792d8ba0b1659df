"""tierd's HiCache backend with a bug planted in it, for tests/test_sglang_faults.py.

SGLang loads it as it loads tierd's (``"module_path": "planted", "class_name":
"PlantedFault"``; the driver's directory is first on its ``sys.path``). With
``TIERD_TEST_PLANTED_FAULT`` set to an exception's name (``TypeError``, ``ValueError``)
while the engine opens (a spec's ``env``), every lookup, load and store of its pages
raises that exception inside the backend's own code, as a bug of tierd's would.
"""

from __future__ import annotations

import builtins
import os
from typing import Any

from tierd.integrations.sglang import TierdHiCache

__all__ = ["PlantedFault"]


class PlantedFault(TierdHiCache):
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        name = os.environ.get("TIERD_TEST_PLANTED_FAULT")
        jobs = self._jobs
        if name is None or jobs is None:
            return
        error = getattr(builtins, name)
        for method in ("leading", "load", "store"):
            setattr(jobs, method, lambda *args, **kwargs: _raise(error))


def _raise(error: type[Exception]) -> Any:
    """The planted bug: one place, whichever call reaches it."""
    raise error("planted in tierd's page jobs")
