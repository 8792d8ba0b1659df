"""Pages/s and GB/s of SGLang's HiCache storage calls: tierd vs SGLang's ``file`` backend
vs a plain memcpy of the same pages, in one run (medians of ``--reps``).

Runs under .venv-sglang's python (scripts/setup_sglang)::

    PYTHON=.venv-sglang/bin/python scripts/bench sglang [--pages-per-call 64] [--reps 5]

``TIERD_BENCH_DIR`` names where the run's files go (the ``file`` backend's, the disk
tiers'; default: the system's temporary directory), say on the NVMe drive to measure.

SGLang's real host pool (``MHATokenToKVPoolHost``, page_first, on CPU) and its own factory
(``StorageBackendFactory``) build the backends; each call is what SGLang's storage threads
make: ``batch_set_v1`` / ``batch_get_v1`` (tierd, ``interface_v1``), or for ``file`` the
controller's generic path (``get_data_page`` + ``batch_set``; ``batch_get`` +
``set_from_flat_data_page``). tierd runs as a real ``tierd serve`` twice: a CPU tier that
holds every page, and a small CPU tier over a disk tier (so loads come from disk); each
with and without the memfd hand-off (``"allocator": "shm"``). Every load is checked byte
for byte. Each rep of a backend is paired with a memcpy rep of the same pool, the two in
turn, and each row gives the median of its reps' own ratios ("x memcpy"): drift on a
shared machine hits both alike. Figures go to docs/BENCHMARKS.md by hand.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any

from bench.figures import median_of
from bench.pagecache import drop_cached

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

# First: declares the two torchvision schemas SGLang's imports need on CPU (driver.py).
from sglang_kit import driver  # noqa: E402

from tierd.testing import DaemonProcess, start_daemon  # noqa: E402

torch = driver.torch
GEOMETRY = {"page": 32, "layers": 8, "heads": 8, "head_dim": 128}  # 1 MiB pages, fp16


def host_pool(pages: int, allocator: str) -> Any:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    g = GEOMETRY
    device = MHATokenToKVPool(
        64,
        g["page"],
        torch.float16,
        g["heads"],
        g["head_dim"],
        g["layers"],
        "cpu",
        False,
        start_layer=0,
        end_layer=g["layers"],
    )
    info = device.get_device_pool_infos()[0].buffer_info
    with host_memory_budget_scope(1 << 34):  # stated, as SGLang's launcher does per rank
        return MHATokenToKVPoolHost(
            info,
            0,
            0,
            g["page"],
            "page_first",
            pin_memory=False,
            device="cpu",
            allocator_type=allocator,
            device_capacity_tokens=64,
            start_layer=0,
            end_layer=g["layers"],
            host_token_capacity=pages * g["page"],
        )


def storage_config(extra: dict[str, Any]) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name="bench-model",
        extra_config=extra,
    )


def serve(
    workdir: Path, block: int, cpu: int, disk: int | None, down: str = ""
) -> tuple[DaemonProcess, str]:
    """A daemon; ``down``: "", or the CPU tier's "write_through" or "write_behind"."""
    sock = tempfile.mkdtemp(prefix="tierd-bench-", dir="/tmp") + "/tierd.sock"
    through = f", {down}: true" if down else ""
    tiers = [f"  - {{name: cpu, kind: cpu, capacity: {cpu}{through}}}"]
    name = f"{cpu}-{down or 'plain'}"
    if disk:
        directory = workdir / f"disk-{name}"
        directory.mkdir(mode=0o700)
        tiers.append(
            f"  - {{name: disk, kind: disk, capacity: {disk}, directories: [{directory}]}}"
        )
    config = workdir / f"tierd-{name}.yaml"
    config.write_text(
        f"block_bytes: {block}\ntiers:\n" + "\n".join(tiers) + f"\nsocket: {{path: {sock}}}\n"
        "limits: {lease_blocks_per_connection: '100%', lease_blocks_per_tenant: '100%'}\n"
    )
    log = workdir / f"tierd-{name}.log"
    # Not this bench's TIERD_BENCH_DIR: the daemon refuses TIERD_* it does not know.
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERD_")}
    daemon = start_daemon(config, env=env, log=log, socket_path=sock, timeout_s=120)
    return daemon, sock  # once READY=1


class Case:
    """One backend over one host pool: a set and a get of ``n`` fresh pages per rep."""

    def __init__(
        self, name: str, pool: Any, backend: Any, generic: bool, between: Any = None
    ) -> None:
        self.name, self.pool, self.backend, self.generic = name, pool, backend, generic
        self.page = GEOMETRY["page"]
        self.between = between  # run untimed between the set and the get

    def run(self, keys: list[str], indices: Any) -> tuple[float, float, bool]:
        started = time.perf_counter()
        stored = self._set(keys, indices)
        set_s = time.perf_counter() - started
        expected = pages_of(self.pool, indices, len(keys))
        self.pool.kv_buffer.view(torch.uint8).zero_()
        if self.between is not None:
            self.between()
        started = time.perf_counter()
        loaded = self._get(keys, indices)
        get_s = time.perf_counter() - started
        ok = stored and loaded and pages_of(self.pool, indices, len(keys)) == expected
        return set_s, get_s, bool(ok)

    def _set(self, keys: list[str], indices: Any) -> bool:
        if not self.generic:
            return all(self.backend.batch_set_v1(keys, indices))
        data = [self.pool.get_data_page(indices[i * self.page]) for i in range(len(keys))]
        return bool(self.backend.batch_set(keys, data))

    def _get(self, keys: list[str], indices: Any) -> bool:
        if not self.generic:
            return all(self.backend.batch_get_v1(keys, indices))
        dummy = [self.pool.get_dummy_flat_data_page() for _ in keys]
        pages = self.backend.batch_get(keys, dummy)
        for i, page in enumerate(pages):
            if page is None:
                return False
            self.pool.set_from_flat_data_page(indices[i * self.page], page)
        return True


def pages_of(pool: Any, indices: Any, n: int) -> list[bytes]:
    """The bytes of ``n`` pages, as SGLang's host pool reads them out."""
    page = GEOMETRY["page"]
    return [
        pool.get_data_page(indices[i * page], flat=True).view(torch.uint8).numpy().tobytes()
        for i in range(n)
    ]


def memcpy_case(pool: Any, indices: Any, n: int) -> tuple[float, float]:
    """The same pages copied out of the pool and back in, piece by piece (numpy)."""
    pointers, sizes = pool.get_page_buffer_meta(indices)
    base = pool.kv_buffer.data_ptr()
    memory = pool.kv_buffer.view(torch.uint8).numpy().reshape(-1)
    out = bytearray(sum(sizes))
    view = memoryview(out)
    started = time.perf_counter()
    at = 0
    for ptr, size in zip(pointers, sizes, strict=True):
        view[at : at + size] = memory[ptr - base : ptr - base + size].data
        at += size
    out_s = time.perf_counter() - started
    started = time.perf_counter()
    at = 0
    for ptr, size in zip(pointers, sizes, strict=True):
        memory[ptr - base : ptr - base + size] = memoryview(out)[at : at + size]
        at += size
    return out_s, time.perf_counter() - started


def push_out(backend: Any, pool: Any, n: int) -> None:
    """Store ``n`` other fresh pages (untimed): under a CPU tier of one call, the pages
    just stored are demoted to the disk tier, so the get reads them from there while the
    CPU tier holds as many pages as a call (as an engine's does, many times over)."""
    indices = pool.alloc(n * GEOMETRY["page"])
    try:
        keys = [os.urandom(32).hex() for _ in range(n)]
        if not all(backend.batch_set_v1(keys, indices)):
            raise RuntimeError("the push-out store failed")
    finally:
        pool.free(indices)


def fill(pool: Any) -> None:
    generator = torch.Generator().manual_seed(1)
    pool.kv_buffer.view(torch.uint8).copy_(
        torch.randint(
            0, 256, pool.kv_buffer.view(torch.uint8).shape, dtype=torch.uint8, generator=generator
        )
    )


def measure(
    case: Case, pool: Any, n: int, reps: int, tag: str, baseline: list[dict[str, float]]
) -> dict[str, Any]:
    """GB/s of ``case`` over ``reps`` after one untimed rep, each rep paired with a memcpy
    rep of the same pool, the two in turn (which goes first alternating), and the median
    of the reps' own ratios to their memcpy: drift on a shared machine hits both alike.
    The memcpy reps are appended to ``baseline`` (the pool's memcpy row)."""
    indices = pool.alloc(n * GEOMETRY["page"])
    samples: dict[str, list[float]] = {"set": [], "get": [], "set_x": [], "get_x": []}
    ok = True

    def one(which: Case | None) -> tuple[float, float, bool]:
        fill(pool)
        if which is None:
            return (*memcpy_case(pool, indices, n), True)
        keys = [os.urandom(32).hex() for _ in range(n)]
        return which.run(keys, indices)

    one(case)  # untimed: the first call connects and maps (the pool fills in behind)
    for rep in range(reps):
        if rep % 2:
            (set_s, get_s, good), (base_set, base_get, _) = one(case), one(None)
        else:
            (base_set, base_get, _), (set_s, get_s, good) = one(None), one(case)
        ok = ok and good
        samples["set"].append(set_s)
        samples["get"].append(get_s)
        samples["set_x"].append(base_set / set_s)
        samples["get_x"].append(base_get / get_s)
        baseline.append({"set": base_set, "get": base_get})
    pool.free(indices)
    row = rate_row(tag, ok, samples, n, pool)
    row |= {f"{op}_x": median_of(samples[f"{op}_x"]) for op in ("set", "get")}
    return row


def rate_row(
    tag: str, ok: bool, samples: dict[str, list[float]], n: int, pool: Any
) -> dict[str, Any]:
    """A row of pages/s and GB/s from the seconds per set and per get of ``n`` pages."""
    nbytes = n * pool.get_size_per_token() * GEOMETRY["page"]
    row: dict[str, Any] = {"case": tag, "ok": ok}
    for op in ("set", "get"):
        median = median_of(samples[op])
        row[f"{op}_pages_s"] = n / median
        row[f"{op}_gb_s"] = nbytes / median / 1e9
    return row


def memcpy_row(paired: list[dict[str, float]], n: int, pool: Any, tag: str) -> dict[str, Any]:
    """The memcpy reps paired with the backends' reps of one pool, as one row."""
    samples = {op: [p[op] for p in paired] for op in ("set", "get")}
    return rate_row(tag, True, samples, n, pool)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pages-per-call", type=int, default=64)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    n, reps = args.pages_per_call, args.reps
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    rows: list[dict[str, Any]] = []
    pools = {alloc: host_pool(2 * n + 1, alloc) for alloc in ("default", "shm")}
    block = pools["default"].get_size_per_token() * GEOMETRY["page"]
    extra = {
        "backend_name": "tierd",
        "module_path": "tierd.integrations.sglang",
        "class_name": "TierdHiCache",
        "interface_v1": 1,
    }
    with tempfile.TemporaryDirectory(dir=os.environ.get("TIERD_BENCH_DIR")) as tmp:
        work = Path(tmp)
        # Each backend's reps alternate with memcpy reps of its pool (SGLang's shm pool is
        # a memfd, tmpfs and shared: its own baseline for the shm rows).
        paired: dict[str, list[dict[str, float]]] = {"default": [], "shm": []}
        file_backend = StorageBackendFactory.create_backend(
            "file", storage_config({"file_storage_path": str(work / "file")}), pools["default"]
        )
        file_backend.register_mem_pool_host(pools["default"])
        rows.append(
            measure(
                Case("file", pools["default"], file_backend, True),
                pools["default"],
                n,
                reps,
                "SGLang file backend (reads from the page cache)",
                paired["default"],
            )
        )
        rows.append(
            measure(
                Case(
                    "file",
                    pools["default"],
                    file_backend,
                    True,
                    lambda: drop_cached(work / "file"),
                ),
                pools["default"],
                n,
                reps,
                "SGLang file backend, its files dropped from the page cache before get",
                paired["default"],
            )
        )
        under = 2 * reps * n + 2 * n  # a disk tier under a CPU tier of one call
        daemons = [
            ("cpu tier", reps * n + n, None, False, ""),
            ("disk tier", 4, reps * n + n, False, ""),
            ("disk tier under a CPU tier of one call", n + 4, under, True, ""),
            (
                "disk tier under a write-through CPU tier of one call",
                n + 4,
                under,
                True,
                "write_through",
            ),
            (
                "disk tier under a write-behind CPU tier of one call",
                n + 4,
                under,
                True,
                "write_behind",
            ),
        ]
        for label, cpu, disk, push, through in daemons:
            proc, sock = serve(work, block, cpu, disk, through)
            try:
                for alloc in ("default", "shm"):
                    backend = StorageBackendFactory.create_backend(
                        "dynamic",
                        storage_config({**extra, "socket": sock, "job_deadline_s": 60}),
                        pools[alloc],
                    )
                    backend.register_mem_pool_host(pools[alloc])
                    how = "memfd hand-off" if alloc == "shm" else "lease copies"
                    between = partial(push_out, backend, pools[alloc], n) if push else None
                    rows.append(
                        measure(
                            Case("tierd", pools[alloc], backend, False, between),
                            pools[alloc],
                            n,
                            reps,
                            f"tierd {label}, {how}",
                            paired[alloc],
                        )
                    )
                    backend.close()
            finally:
                proc.stop()
    memcpy = [
        memcpy_row(paired["default"], n, pools["default"], "memcpy (numpy, same pages)"),
        memcpy_row(paired["shm"], n, pools["shm"], "memcpy (numpy), shm pool"),
    ]
    rows = memcpy + rows
    mib = block / 2**20
    print(
        f"pages of {mib:g} MiB, {n} pages per call, median of {reps}; set = batch_set_v1, "
        "get = batch_get_v1 (file: the generic batch_set/batch_get path)\n"
    )
    print("x memcpy: the median of each rep's ratio to the memcpy rep of the same pool beside it\n")
    columns = ["set pages/s", "set GB/s", "set x memcpy", "get pages/s", "get GB/s"]
    print("| case | " + " | ".join(columns) + " | get x memcpy | bytes checked |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        set_x = f"{r['set_x']:.2f}x" if "set_x" in r else "-"
        get_x = f"{r['get_x']:.2f}x" if "get_x" in r else "-"
        print(
            f"| {r['case']} | {r['set_pages_s']:.0f} | {r['set_gb_s']:.2f} | {set_x} | "
            f"{r['get_pages_s']:.0f} | {r['get_gb_s']:.2f} | {get_x} | "
            f"{'yes' if r['ok'] else 'NO'} |"
        )
    return 0


if __name__ == "__main__":
    threading.current_thread().name = "bench"
    raise SystemExit(main())
