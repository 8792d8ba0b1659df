"""One SGLang "engine" for the tests of tierd.integrations.sglang: SGLang's real host
pool and HiCacheController on CPU, driven by JSON commands on stdin.

Run with .venv-sglang's python (scripts/setup_sglang); one JSON command per line on
stdin, one JSON answer per line on stdout. ``{"op": "open", "engine": NAME, "spec":
{...}}`` builds an engine (its pools and controller; tests/sglang_kit/engines.py writes
the specs); the other commands name the engine they address:

- ``{"op": "write", "seed": 1, "pages": 16}``: fill host pages with the bytes of
  ``seed`` and back them up through ``HiCacheController.write_storage`` (SGLang's backup
  thread, ``_page_backup``, the backend's ``batch_set_v1``); answers the pages stored.
  With ``"start": N`` only pages N.. are written, as a later turn of the same sequence:
  SGLang's ``prefix_keys`` (the hashes of pages 0..N-1) go with them.
- ``{"op": "read", "seed": 1, "pages": 16}``: ``HiCacheController.prefetch`` (SGLang's
  prefetch thread, ``_storage_hit_query``, the backend's ``batch_exists``), the
  scheduler's step (host buffers for the hit), then SGLang's ``_page_transfer`` (the
  backend's ``batch_get_v1``); answers hit and loaded pages and compares every loaded
  page with the bytes of ``seed``.
- ``"freeze_after": N`` in a ``write`` or ``read``: this process stops itself (SIGSTOP,
  as a debugger, a cgroup freeze or a swap storm holds a process) after N page copies
  into (write) or out of (read) the daemon's pool, in the middle of the call, until the
  test sends SIGCONT. Only where it stops is chosen here; the stop is the kernel's.
  ``"stop_daemon": [PID, N]`` stops the daemon (process PID) so instead.
- ``{"op": "trace"}``: from then on, where each backend call of this process spends
  its time (``LookupTrace``); each answer takes the calls traced since the last.
- ``{"op": "clear"}``: what SGLang's ``POST /hicache/storage-backend/clear`` runs
  (``clear_storage_backend``); answers what SGLang would tell the operator.
- ``{"op": "close_and_call"}``: SGLang's detach (it closes the backend), then every
  call of the backend once more; answers each one's result or what it raised.
- ``{"op": "stats"}`` (with ``tierd_logs``: what tierd logged through the logging
  SGLang configures, at its default level), ``{"op": "log"}`` (``tierd_logs`` alone,
  no engine needed), ``{"op": "quit"}``.

A spec with ``launch_extra`` (the extra config as given on SGLang's command line, JSON
or ``@file``) has its allocator and extra config derived by SGLang's own code.

What is not SGLang's here: the device-side allocator is a two-method holder of the CPU
device pool (``get_kvcache``), and the scheduler step between the hit query and the
transfer (SGLang's radix cache does it) is the few lines of ``_schedule``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import queue
import random
import signal
import sys
import threading
import time
import traceback
from typing import Any

import torch

# torchvision's CUDA-only wheel (the one the index serves for torch 2.13) registers fake
# kernels for two operators its missing native library would define; SGLang imports
# torchvision only for multimodal configs. Declaring the two schemas lets it import.
_TORCHVISION_OPS = torch.library.Library("torchvision", "DEF")
_TORCHVISION_OPS.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
_TORCHVISION_OPS.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")

from sglang.srt.managers.cache_controller import HiCacheController  # noqa: E402
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (  # noqa: E402
    HybridCacheController,
)
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope  # noqa: E402
from sglang.srt.mem_cache.pool_host.common import get_allocator_type  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.utils import get_storage_hash_str  # noqa: E402
from sglang.srt.runtime_context import _ConfigBag, get_context, get_parallel  # noqa: E402
from sglang.srt.utils.common import configure_logger  # noqa: E402

ANSWER_TAG = "@@answer "
HOST_BUDGET_BYTES = 1 << 30  # the test pools take a few MiB
WAIT_S = 60.0  # safety net for SGLang's queues (its threads poll them every second)
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


class ErrorCount(logging.Handler):
    """Counts what SGLang's controller logs at ERROR: an exception a backend raised into
    SGLang's storage threads is caught there and logged so."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.count = 0
        self.last: str | None = None

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1
        self.last = record.getMessage()


ERRORS = ErrorCount()


class TierdLines(logging.Handler):
    """Keeps what tierd's loggers write through the logging SGLang configured (the
    root logger, at SGLang's default level, INFO): ``[level, message]`` pairs."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[list[str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.startswith("tierd"):
            self.lines.append([record.levelname, record.getMessage()])
            del self.lines[:-200]


TIERD_LINES = TierdLines()


class DeviceAllocator:
    """What HiCacheController asks of SGLang's device allocator on this path."""

    def __init__(self, kvcache: Any) -> None:
        self._kvcache = kvcache

    def get_kvcache(self) -> Any:
        return self._kvcache

    def set_hicache_transfer_done_event(self, *args: Any) -> None:
        return None


def launch_config(spec: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The host pool's allocator and the backend's extra config, as SGLang's launcher
    derives them from ``--hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config ARG`` when the spec has ``launch_extra``
    (ARG: JSON, or ``@file``): SGLang's own ``get_allocator_type`` reads ARG from its
    published memory config, and its own parser reads the extra config. Else the spec's
    ``allocator`` and ``extra``."""
    arg = spec.get("launch_extra")
    if arg is None:
        return spec.get("allocator", "default"), dict(spec.get("extra", {}))
    memory = _ConfigBag("memory")  # the two leaves get_allocator_type reads
    memory._set("hicache_storage_backend", "dynamic")
    memory._set("hicache_storage_backend_extra_config", arg)
    context = get_context()
    published, context._config_bags = context._config_bags, {"memory": memory}
    try:
        allocator = get_allocator_type()
    finally:
        context._config_bags = published
    extra, *_ = HybridCacheController.parse_storage_backend_extra_config(arg)
    return allocator, extra


def build(spec: dict[str, Any]) -> tuple[HiCacheController, Any]:
    """SGLang's device pool, host pool and controller for ``spec``."""
    get_parallel().override_permanently(
        tp_rank=spec.get("tp_rank", 0),
        tp_size=spec.get("tp_size", 1),
        pp_rank=0,
        pp_size=1,
        attn_dcp_size=1,
        attn_dcp_rank=0,
    )
    page, layers, dtype = spec["page"], spec["layers"], DTYPES[spec.get("dtype", "float16")]
    allocator, extra = launch_config(spec)
    tokens = spec.get("device_tokens", 256)
    common = {
        "pin_memory": False,
        "device": "cpu",
        "allocator_type": allocator,
        "device_capacity_tokens": tokens,
        "start_layer": 0,
        "end_layer": layers,
    }
    # The budget SGLang's launcher states per rank; unstated, SGLang samples the free
    # memory of the whole machine less a fixed reserve, which a busy CI box may not have.
    with host_memory_budget_scope(HOST_BUDGET_BYTES):
        if spec.get("mla"):
            device = MLATokenToKVPool(
                tokens, page, dtype, spec["lora"], spec["rope"], layers, "cpu", False
            )
            info = device.get_device_pool_infos()[0].buffer_info
            host = MLATokenToKVPoolHost(
                info,
                0,
                0,
                page,
                spec["layout"],
                target_layer_num=layers,
                host_token_capacity=spec["host_pages"] * page,
                **common,
            )
        else:
            device = MHATokenToKVPool(
                tokens,
                page,
                dtype,
                spec["heads"],
                spec["head_dim"],
                layers,
                "cpu",
                False,
                start_layer=0,
                end_layer=layers,
            )
            info = device.get_device_pool_infos()[0].buffer_info
            host = MHATokenToKVPoolHost(
                info,
                0,
                0,
                page,
                spec["layout"],
                host_token_capacity=spec["host_pages"] * page,
                **common,
            )
    controller = HiCacheController(
        DeviceAllocator(device),
        host,
        page,
        None,
        threading.Event(),
        storage_backend=spec["backend"],
        model_name=spec.get("model", "tiny-model"),
        storage_backend_extra_config=extra,
        prefetch_threshold=page,
    )
    return controller, host


def tokens_of(seed: int, pages: int, page: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 32000) for _ in range(pages * page)]


def page_bytes(seed: int, i: int, size: int) -> bytes:
    """The bytes of page ``i`` of ``seed``'s sequence: the same in every process."""
    out = bytearray()
    counter = 0
    while len(out) < size:
        out += hashlib.sha256(f"{seed}/{i}/{counter}".encode()).digest()
        counter += 1
    return bytes(out[:size])


class Engine:
    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.cc, self.host = build(spec)
        self.page = spec["page"]
        self.flat = self.host.get_dummy_flat_data_page()
        self.size = self.flat.numel() * self.flat.element_size()
        self.requests = 0

    def fill(self, seed: int, indices: torch.Tensor, pages: range) -> None:
        for n, i in enumerate(pages):
            data = torch.frombuffer(bytearray(page_bytes(seed, i, self.size)), dtype=torch.uint8)
            self.host.set_from_flat_data_page(
                int(indices[n * self.page]), data.view(self.flat.dtype)
            )

    def write(self, seed: int, pages: int, start: int = 0) -> dict[str, Any]:
        """Back up pages ``start..pages-1`` of ``seed``'s sequence (``start`` > 0: a later
        turn, with SGLang's prefix keys, the hashes of the pages before it)."""
        indices = self.host.alloc((pages - start) * self.page)
        self.fill(seed, indices, range(start, pages))
        tokens = tokens_of(seed, pages, self.page)
        hashes = get_storage_hash_str(tokens, None, page_size=self.page)
        started = time.monotonic()
        prefix = hashes[:start] if start else None
        op_id = self.cc.write_storage(
            indices, tokens[start * self.page :], hash_value=hashes[start:], prefix_keys=prefix
        )
        op = self.cc.ack_backup_queue.get(timeout=WAIT_S)
        if op.id != op_id:
            raise RuntimeError(f"backup ack for {op.id}, not {op_id}")
        self.host.free(indices)
        return {
            "stored_pages": op.completed_tokens // self.page,
            "took_s": time.monotonic() - started,
        }

    def read(self, seed: int, pages: int, reuse_s: float = 0.0) -> dict[str, Any]:
        """SGLang's prefetch of ``seed``'s pages. With ``reuse_s``, the pages a failed
        load gave up are reused at once (a sentinel written, as SGLang would hand them
        to another request), and after ``reuse_s`` the answer says how many of them no
        longer hold it (``overwritten``: a late write of the backend's)."""
        self.requests += 1
        tokens = tokens_of(seed, pages, self.page)
        started = time.monotonic()
        op = self.cc.prefetch(f"req-{self.requests}", tokens)
        hit = self.cc.prefetch_hit_queue.get(timeout=WAIT_S)
        if hit is not op:
            raise RuntimeError("prefetch hit for another operation")
        hit_pages = op.storage_hit_count // self.page
        answer = {"hit_pages": hit_pages, "loaded_pages": 0, "identical": 0, "digests": []}
        if hit_pages:
            loaded = self._schedule(op, hit_pages)
            answer.update(self._compare(seed, op.host_indices, loaded))
            if reuse_s:
                answer["overwritten"] = self._reuse(op.host_indices, loaded, hit_pages, reuse_s)
            self.host.free(op.host_indices)
        answer["took_s"] = time.monotonic() - started
        return answer

    def _schedule(self, op: Any, hit_pages: int) -> int:
        """The scheduler's part (SGLang's radix cache): host buffers for the hit, then the
        transfer by SGLang's prefetch I/O thread; returns the pages loaded."""
        op.host_indices = self.cc.alloc_prefetch_host_buffers(op, hit_pages * self.page)
        self.host.kv_buffer.view(torch.uint8).zero_()  # nothing stale can pass for a load
        self.cc.prefetch_buffer.put(op)
        completed = 0
        while True:
            ack = self.cc.ack_prefetch_queue.get(timeout=WAIT_S)
            if ack.completed_tokens is not None:
                completed = ack.completed_tokens
            if ack.completed_req:
                return completed // self.page

    def _reuse(self, indices: torch.Tensor, loaded: int, hit: int, wait_s: float) -> int:
        sentinel = torch.full((self.size,), 0xA5, dtype=torch.uint8)
        given_up = [int(indices[i * self.page]) for i in range(loaded, hit)]
        for index in given_up:
            self.host.set_from_flat_data_page(index, sentinel.view(self.flat.dtype))
        time.sleep(wait_s)  # the daemon's late copies, if any, land meanwhile
        overwritten = 0
        for index in given_up:
            got = self.host.get_data_page(index, flat=True).contiguous().view(torch.uint8)
            overwritten += not bool(torch.equal(got, sentinel))
        return overwritten

    def _compare(self, seed: int, indices: torch.Tensor, loaded: int) -> dict[str, Any]:
        identical, digests = 0, []
        for i in range(loaded):
            got = self.host.get_data_page(int(indices[i * self.page]), flat=True)
            raw = got.contiguous().view(torch.uint8).numpy().tobytes()
            identical += raw == page_bytes(seed, i, self.size)
            digests.append(hashlib.sha256(raw).hexdigest()[:16])
        return {"loaded_pages": loaded, "identical": identical, "digests": digests}

    def stats(self) -> dict[str, Any]:
        backend = self.cc.storage_backend
        inner = getattr(backend, "_backend", backend)  # SGLang's failure injector wraps it
        return {
            "backend": type(backend).__name__,
            "namespace": getattr(inner, "namespace", None),
            "page_bytes": self.size,
            "totals": dict(getattr(getattr(inner, "counters", None), "totals", {}) or {}),
            "memfd": bool(getattr(getattr(inner, "_jobs", None), "zero_copy", False)),
            "sglang_errors": ERRORS.count,
            "last_error": ERRORS.last,
            "tierd_logs": list(TIERD_LINES.lines),
        }

    def close_and_call(self) -> dict[str, Any]:
        """SGLang's detach (which closes the backend), then every call of the backend
        once more (a late thread of SGLang's): each one's answer, or what it raised."""
        backend = self.cc.storage_backend
        self.cc.detach_storage_backend()
        keys = get_storage_hash_str(tokens_of(1, 1, self.page), None, page_size=self.page)
        indices = self.host.alloc(self.page)
        calls = {
            "batch_exists": lambda: backend.batch_exists(keys),
            "batch_get_v1": lambda: backend.batch_get_v1(keys, indices),
            "batch_set_v1": lambda: backend.batch_set_v1(keys, indices),
            "exists": lambda: backend.exists(keys[0]),
            "clear": backend.clear,
            "close": backend.close,
        }
        answers: dict[str, Any] = {}
        for name, call in calls.items():
            try:
                answers[name] = call()
            except Exception as exc:
                answers[name] = f"raised {type(exc).__name__}: {exc}"
        self.host.free(indices)
        return answers


def stop_this_thread() -> None:
    """Stop this process here, at this thread's next instruction. A SIGSTOP sent to the
    process (``os.kill(os.getpid())``) is taken by whichever thread the kernel picks,
    often the main one asleep in a read: until it runs, this thread goes on copying (seen
    on a loaded 2-core machine: a whole load done and its lease ended before the stop).
    Sent to this thread, the stop is taken on the way out of the call itself."""
    signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)


def freeze_after(copies: int, method: str, pid: int | None = None) -> None:
    """Stop this process (or process ``pid``: the daemon) after ``copies`` calls of
    ``PageBlocks.<method>`` (a page copied into the daemon's pool: ``gather_one``; out
    of it: ``fill_one``), before the last."""
    from tierd.integrations.sglang import pages as sglang_pages

    original = getattr(sglang_pages.PageBlocks, method)
    count = 0

    def counted(self: Any, position: int, view: memoryview) -> None:
        nonlocal count
        count += 1
        if count == copies:
            setattr(sglang_pages.PageBlocks, method, original)
            if pid is None:
                stop_this_thread()
            else:
                os.kill(pid, signal.SIGSTOP)
        original(self, position, view)

    counted.unarmed = original  # type: ignore[attr-defined]
    setattr(sglang_pages.PageBlocks, method, counted)


class LookupTrace:
    """Where each ``batch_exists`` of this process spends its time, on the engine's
    side: ``(enter, connected, sent, replied, returned)`` as ``time.monotonic()``
    seconds (``connected``: after the thread's connection was found or made; ``sent``:
    the lookup request written; ``replied``: its reply read), the deadline it was given
    (``deadline_s``), the thread's own CPU seconds over the call, whether it made a new
    connection, and what it answered; ``batch_get_v1`` and ``batch_set_v1`` calls with
    their ``enter``, ``returned`` and ``job_deadline_s``. Every call's ``steps``: the
    client's requests, posts, connects and closes, the channel's drops, the link's
    failure reports and each page copy, as ``[name, began, ended, outcome]`` (seconds
    after ``enter``)."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self._local = threading.local()
        self._installed = False

    def install(self) -> None:
        if self._installed:
            return
        self._installed = True
        from tierd.control.clients.blocking_client import BlockingClient
        from tierd.integrations.core.channel import EngineChannel
        from tierd.integrations.core.link import DaemonLink
        from tierd.integrations.sglang import TierdHiCache
        from tierd.integrations.sglang import pages as sglang_pages
        from tierd.integrations.sglang.page_jobs import PageJobs

        trace = self
        exists, connected = TierdHiCache.batch_exists, EngineChannel._connected
        lookup_deadline = getattr(PageJobs, "lookup_deadline", None)  # None: before the fix
        requests = BlockingClient.requests
        send, replies = BlockingClient._send, BlockingClient._replies

        def timed(op: str, method: Any) -> Any:
            def call(backend: Any, keys: list[str], *args: Any, **kwargs: Any) -> Any:
                record: dict[str, Any] = {"op": op, "enter": time.monotonic(), "keys": len(keys)}
                record["job_deadline_s"] = backend.settings.job_deadline_s
                cpu = time.thread_time()
                trace._local.record = record
                try:
                    record["found"] = method(backend, keys, *args, **kwargs)
                finally:
                    record["returned"] = time.monotonic()
                    record["thread_cpu"] = time.thread_time() - cpu
                    trace._local.record = None
                    trace.calls.append(record)
                return record["found"]

            return call

        def deadline_of(jobs: Any) -> float:
            value = float(lookup_deadline(jobs)) if lookup_deadline else jobs.lookup_deadline_s
            record = getattr(trace._local, "record", None)
            if record is not None:
                record["deadline_s"] = value
            return value

        def made(channel: Any, deadline: float) -> Any:
            record = getattr(trace._local, "record", None)
            before = channel.here()
            conn = connected(channel, deadline)
            if record is not None:
                record["connected"] = time.monotonic()
                record["new_connection"] = conn is not before
            return conn

        def traced(method: Any, name: str) -> Any:
            def wrapper(client: Any, *args: Any) -> Any:
                out = method(client, *args)
                record = getattr(trace._local, "record", None)
                if record is not None and getattr(trace._local, "lookup", False):
                    record[name] = time.monotonic()
                return out

            return wrapper

        def lookup_requests(client: Any, op: str, each: Any, deadline: float) -> Any:
            trace._local.lookup = op == "lookup"
            try:
                return requests(client, op, each, deadline)
            finally:
                trace._local.lookup = False

        def step(owner: Any, name: str) -> None:
            method = getattr(owner, name, None)
            if method is None:  # not in this version of tierd
                return

            def wrapper(*args: Any, **kwargs: Any) -> Any:
                record = getattr(trace._local, "record", None)
                began, outcome = time.monotonic(), "ok"
                try:
                    return method(*args, **kwargs)
                except BaseException as exc:
                    outcome = type(exc).__name__
                    raise
                finally:
                    if record is not None:
                        label = name if name != "requests" else f"requests:{args[1]}"
                        ended = time.monotonic() - record["enter"]
                        began_at = round(began - record["enter"], 4)
                        step = [label, began_at, round(ended, 4), outcome]
                        record.setdefault("steps", []).append(step)

            setattr(owner, name, wrapper)

        TierdHiCache.batch_exists = timed("batch_exists", exists)  # type: ignore[method-assign]
        for op in ("batch_get_v1", "batch_set_v1"):
            setattr(TierdHiCache, op, timed(op, getattr(TierdHiCache, op)))
        EngineChannel._connected = made  # type: ignore[method-assign]
        BlockingClient.requests = lookup_requests  # type: ignore[method-assign]
        if lookup_deadline is not None:
            PageJobs.lookup_deadline = deadline_of  # type: ignore[method-assign]
        BlockingClient._send = traced(send, "sent")  # type: ignore[method-assign]
        BlockingClient._replies = traced(replies, "replied")  # type: ignore[method-assign]

        for owner, name in [
            (BlockingClient, "requests"),
            (BlockingClient, "post"),
            (BlockingClient, "close"),
            (EngineChannel, "_drop"),
            (EngineChannel, "_release"),
            (DaemonLink, "report_failure"),
            (DaemonLink, "count_call"),
            (BlockingClient, "connect"),
            (sglang_pages.PageBlocks, "gather_one"),
            (sglang_pages.PageBlocks, "fill_one"),
        ]:
            step(owner, name)

    def take(self) -> list[dict[str, Any]]:
        calls, self.calls = self.calls, []
        return calls


TRACE = LookupTrace()


def serve(engines: dict[str, Engine], command: dict[str, Any]) -> dict[str, Any]:
    """One command; SGLang's own exceptions propagate (the caller reports them)."""
    op, name = command["op"], command.get("engine", "main")
    if op == "trace":  # LookupTrace: installed at the first, each answer takes its calls
        TRACE.install()
        return {"calls": TRACE.take()}
    if op == "open":
        spec = command["spec"]
        env = dict(spec.get("env", {}))  # SGLang reads its injector's variables at attach
        os.environ.update(env)
        try:
            engines[name] = Engine(spec)
        except Exception as exc:  # a refused start-up is what some tests look for
            return {"refused": f"{type(exc).__name__}: {exc}"}
        finally:
            for key in env:
                os.environ.pop(key, None)
        return {"ready": True, **engines[name].stats()}
    if op == "log":
        return {"tierd_logs": list(TIERD_LINES.lines)}
    engine = engines[name]
    method = "gather_one" if op == "write" else "fill_one"
    if command.get("freeze_after"):
        freeze_after(command["freeze_after"], method)
    if command.get("stop_daemon"):  # [pid, copies]: the daemon stopped mid-transfer
        pid, copies = command["stop_daemon"]
        freeze_after(copies, method, pid)
        try:  # a transfer that copied fewer pages leaves no stop armed for the next one
            return serve(engines, {k: v for k, v in command.items() if k != "stop_daemon"})
        finally:
            from tierd.integrations.sglang import pages as sglang_pages

            original = getattr(sglang_pages.PageBlocks, method)
            setattr(sglang_pages.PageBlocks, method, getattr(original, "unarmed", original))
    if op == "write":
        return engine.write(command["seed"], command["pages"], command.get("start", 0))
    if op == "read":
        return engine.read(command["seed"], command["pages"], command.get("reuse_s", 0.0))
    if op == "clear":  # what POST /hicache/storage-backend/clear runs, and answers
        return {"cleared": HybridCacheController.clear_storage_backend(engine.cc)}
    if op == "close":
        engine.cc.detach_storage_backend()
        del engines[name]
        return {"closed": name}
    if op == "close_and_call":
        del engines[name]
        return engine.close_and_call()
    return engine.stats()


def answer(reply: dict[str, Any]) -> None:
    """One answer line; tagged, since loggers may print on stdout too."""
    print(ANSWER_TAG + json.dumps(reply), flush=True)


def main() -> None:
    """Engines by name (``open``), then commands on them until ``quit`` or end of input."""
    if sys.argv[1:] == ["--check"]:  # scripts/setup_sglang: does everything import?
        import sglang.srt.mem_cache.storage.backend_factory  # noqa: F401

        import tierd.integrations.sglang  # noqa: F401

        print("SGLang's HiCache stack and tierd.integrations.sglang import")
        return
    configure_logger(argparse.Namespace(log_level="info"), prefix=" TP0")  # SGLang's default
    logging.getLogger("sglang").addHandler(ERRORS)
    logging.getLogger().addHandler(TIERD_LINES)
    engines: dict[str, Engine] = {}
    answer({"started": True})
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "quit":
            break
        try:
            reply = serve(engines, command)
        except queue.Empty:
            reply = {"error": "SGLang's queue gave nothing within the safety deadline"}
        except Exception as exc:
            traceback.print_exc()
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        answer(reply)
    for engine in engines.values():
        engine.cc.detach_storage_backend()


if __name__ == "__main__":
    main()
