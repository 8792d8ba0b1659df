"""An LMCache "server" process for tests/test_lmcache.py, run by .venv-lmcache's python.

It builds tierd's L2 adapter the way LMCache's server and its ``lmcache bench l2`` do
(``parse_args_to_l2_adapters_config`` of the documented ``--l2-adapter`` JSON, then
``create_l2_adapter``), makes keys and memory objects with LMCache's own classes, and
waits on the adapter's event fds as LMCache's controllers do. It reads one JSON command
per line on stdin and answers each with one line ``@@answer {json}`` on stdout:

- ``{"op": "store", "seed": s, "count": n}``: store n objects whose bytes derive from s.
- ``{"op": "load", "seed": s, "count": n}``: lookup-and-lock, load into fresh objects,
  compare with what a store of s put there, unlock.
- ``{"op": "lock" | "unlock" | "delete", "seed": s, "count": n}``: lookup-and-lock only,
  unlock, or the adapter's ``delete`` of those keys.
- ``{"op": "as_user", "model": m, "salt": s}``: later keys name model m, cache salt s.
- ``{"op": "status"}``: the adapter's ``report_status()``; ``{"op": "quit"}``.

With a ``"serde"`` sub-dict in the JSON the adapter is wrapped as LMCache's storage
manager wraps it (``SerdeL2AdapterWrapper`` around it, temporary buffers from a real
``L1Manager``); the objects are then bf16 tensors of ``block`` bytes, and a load counts as
``identical`` when it equals what the fp8 round trip of the stored tensor gives, and as
``within`` when it is within fp8's tolerance of the stored tensor (``exact``: equal to it).

Every answer carries each task's wall time. ``--in-loop`` (after the arguments) builds the
adapter inside a running event loop, as LMCache's MP server does. ``--check`` only imports
(scripts/setup_lmcache).
"""

from __future__ import annotations

import asyncio
import json
import select
import sys
import time
from typing import Any

ANSWER_TAG = "@@answer "
WAIT_S = 60.0  # a task not finished by then is reported as never finished


def adapter_json(socket_path: str, **params: Any) -> str:
    return json.dumps(
        {
            "type": "plugin",
            "module_path": "tierd.integrations.lmcache",
            "class_name": "TierdL2Adapter",
            "adapter_params": {"socket": socket_path, **params},
        }
    )


def check() -> None:
    import lmcache
    from lmcache.v1.distributed.l2_adapters import plugin_l2_adapter  # noqa: F401

    import tierd.integrations.lmcache  # noqa: F401

    version = getattr(lmcache, "__version__", "?")
    print(f"lmcache {version}: plugin loader and tierd's adapter import")


class Server:
    def __init__(self, spec: str, block: int, model: str, in_loop: bool = False) -> None:
        import argparse

        import torch
        from lmcache.v1.distributed.l2_adapters import create_l2_adapter
        from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config

        self.torch = torch
        config = parse_args_to_l2_adapters_config(argparse.Namespace(l2_adapter=[spec]))
        adapter_config = config.adapters[0]
        if in_loop:  # as LMCache's MP server does: inside its HTTP frontend's event loop

            async def build() -> Any:
                return create_l2_adapter(adapter_config)

            self.adapter = asyncio.run(build())
        else:
            self.adapter = create_l2_adapter(adapter_config)
        self.serde = adapter_config.serde_config is not None
        self.l1: Any = None
        if self.serde:
            self.adapter = self.with_serde(self.adapter, adapter_config.serde_config)
        self.block = block
        self.model = model
        self.salt = ""  # LMCache's per-user isolation (the ``salt`` command sets it)

    def with_serde(self, inner: Any, serde_config: Any) -> Any:
        """``inner`` wrapped as LMCache's StorageManager wraps an adapter with serde."""
        from lmcache.v1.distributed.config import L1ManagerConfig, L1MemoryManagerConfig
        from lmcache.v1.distributed.l1_manager import L1Manager
        from lmcache.v1.distributed.l2_adapters.serde_wrapper import SerdeL2AdapterWrapper
        from lmcache.v1.distributed.serde import create_serde_processor

        memory = L1MemoryManagerConfig(size_in_bytes=64 << 20, use_lazy=False, shm_name="")
        self.l1 = L1Manager(L1ManagerConfig(memory_config=memory))
        serde = create_serde_processor(serde_config)
        return SerdeL2AdapterWrapper(inner=inner, serde=serde, l1_manager=self.l1)

    def keys(self, seed: int, count: int) -> list[Any]:
        from lmcache.v1.distributed.api import ObjectKey

        return [
            ObjectKey(
                chunk_hash=(seed * 1_000_003 + i).to_bytes(16, "big"),
                model_name=self.model,
                kv_rank=i % 2,
                cache_salt=self.salt,
            )
            for i in range(count)
        ]

    def pattern(self, seed: int, i: int) -> Any:
        torch = self.torch
        if self.serde:  # KV-like bf16 values, as bytes
            generator = torch.Generator().manual_seed(seed * 1_000_003 + i)
            values = torch.randn(self.block // 2, generator=generator).to(torch.bfloat16)
            return values.view(torch.uint8)
        step = (seed * 31 + i * 7) % 251 + 1
        return ((torch.arange(self.block, dtype=torch.int64) * step + i) % 256).to(torch.uint8)

    def objects(self, count: int, fill: Any = None) -> list[Any]:
        from lmcache.v1.memory_management import (
            MemoryFormat,
            MemoryObjMetadata,
            TensorMemoryObj,
        )

        torch = self.torch
        out = []
        for i in range(count):
            raw = torch.zeros(self.block, dtype=torch.uint8)
            if fill is not None:
                raw.copy_(fill(i))
            dtype = torch.bfloat16 if self.serde else torch.uint8
            shape = torch.Size([self.block // dtype.itemsize])
            meta = MemoryObjMetadata(
                shape=shape,
                dtype=dtype,
                address=0,
                phy_size=self.block,
                fmt=MemoryFormat.KV_2LTD,
                ref_count=1,
                shapes=[shape],
                dtypes=[dtype],
            )
            out.append(TensorMemoryObj(raw_data=raw, metadata=meta, parent_allocator=None))
        return out

    def wait(self, fd: int, done: Any) -> Any:
        """Wait on ``fd`` until ``done()`` returns non-None, at most WAIT_S."""
        from lmcache.v1.platform import consume_fd

        poller = select.poll()
        poller.register(fd, select.POLLIN)
        deadline = time.monotonic() + WAIT_S
        while True:
            result = done()
            if result is not None:
                return result
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if poller.poll(left * 1000):
                consume_fd(fd)

    def store(self, seed: int, count: int) -> dict[str, Any]:
        keys = self.keys(seed, count)
        objs = self.objects(count, lambda i: self.pattern(seed, i))
        started = time.monotonic()
        task = self.adapter.submit_store_task(keys, objs)
        results: dict[int, Any] = {}

        def popped() -> Any:
            results.update(self.adapter.pop_completed_store_tasks())
            return results.get(task)

        result = self.wait(self.adapter.get_store_event_fd(), popped)
        elapsed = time.monotonic() - started
        if result is None:
            return {"finished": False, "ok": False, "elapsed_s": elapsed}
        return {
            "finished": True,
            "ok": result.is_successful(),
            "bytes": result.bytes_transferred(),
            "elapsed_s": elapsed,
        }

    def load(self, seed: int, count: int) -> dict[str, Any]:
        keys = self.keys(seed, count)
        started = time.monotonic()
        task = self.adapter.submit_lookup_and_lock_task(keys, {})
        fd = self.adapter.get_lookup_and_lock_event_fd()
        found = self.wait(fd, lambda: self.adapter.query_lookup_and_lock_result(task))
        lookup_s = time.monotonic() - started
        if found is None:
            return {"finished": False, "lookup_s": lookup_s}
        hits = [i for i in range(count) if found.test(i)]
        if self.serde and not hits:  # LMCache's serde wrapper raises IndexError on no keys
            return {"finished": True, "found": 0, "loaded": 0, "lookup_s": lookup_s}
        objs = self.objects(count)
        started = time.monotonic()
        task = self.adapter.submit_load_task([keys[i] for i in hits], [objs[i] for i in hits])
        fd = self.adapter.get_load_event_fd()
        loaded = self.wait(fd, lambda: self.adapter.query_load_result(task))
        load_s = time.monotonic() - started
        self.adapter.submit_unlock([keys[i] for i in hits])
        if loaded is None:
            return {"finished": False, "found": len(hits), "lookup_s": lookup_s}
        good = [hits[j] for j in range(len(hits)) if loaded.test(j)]
        answer = {
            "finished": True,
            "found": len(hits),
            "loaded": len(good),
            "lookup_s": lookup_s,
            "load_s": load_s,
        }
        if self.serde:
            return answer | self.compare_fp8(seed, [(i, objs[i]) for i in good])
        same = sum(bool(self.torch.equal(objs[i].raw_data, self.pattern(seed, i))) for i in good)
        return answer | {"identical": same}

    def compare_fp8(self, seed: int, loaded: list[tuple[int, Any]]) -> dict[str, int]:
        """How many loaded bf16 objects equal the fp8 round trip of what was stored
        (``identical``), lie within fp8 e4m3's tolerance of it (``within``: relative
        2**-4, absolute 2**-9 near zero) or equal it (``exact``)."""
        torch = self.torch
        counts = {"identical": 0, "within": 0, "exact": 0}
        for i, obj in loaded:
            stored = self.pattern(seed, i).view(torch.bfloat16)
            got = obj.raw_data.view(torch.bfloat16)
            expected = stored.to(torch.float8_e4m3fn).to(torch.bfloat16)
            counts["identical"] += bool(torch.equal(got, expected))
            counts["within"] += bool(torch.allclose(got, stored, rtol=2**-4, atol=2**-9))
            counts["exact"] += bool(torch.equal(got, stored))
        return counts

    def as_user(self, model: str, salt: str) -> dict[str, Any]:
        """Later keys name ``model`` and carry ``salt``."""
        self.model, self.salt = model, salt
        return {"model": model, "salt": salt}

    def lock(self, seed: int, count: int) -> dict[str, Any]:
        """Lookup-and-lock only; the keys stay locked until ``unlock``."""
        keys = self.keys(seed, count)
        task = self.adapter.submit_lookup_and_lock_task(keys, {})
        fd = self.adapter.get_lookup_and_lock_event_fd()
        found = self.wait(fd, lambda: self.adapter.query_lookup_and_lock_result(task))
        if found is None:
            return {"finished": False}
        return {"finished": True, "found": sum(found.test(i) for i in range(count))}

    def unlock(self, seed: int, count: int) -> dict[str, Any]:
        self.adapter.submit_unlock(self.keys(seed, count))
        return {"unlocked": count}

    def delete(self, seed: int, count: int) -> dict[str, Any]:
        self.adapter.delete(self.keys(seed, count))
        return {"deleted": count}

    def serve(self) -> None:
        print(ANSWER_TAG + json.dumps({"started": True}), flush=True)
        for line in sys.stdin:
            command = json.loads(line)
            op = command.pop("op")
            if op == "quit":
                break
            if op == "status":
                answer: dict[str, Any] = self.adapter.report_status()
            else:
                answer = getattr(self, op)(**command)
            print(ANSWER_TAG + json.dumps(answer, default=str), flush=True)
        self.adapter.close()
        if self.l1 is not None:
            self.l1.close()


def main() -> None:
    if sys.argv[1:] == ["--check"]:
        check()
        return
    spec, block, model = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    Server(spec, block, model, in_loop=sys.argv[4:] == ["--in-loop"]).serve()


if __name__ == "__main__":
    main()
