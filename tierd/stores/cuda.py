"""Small CUDA helpers for the stores: availability, host-memory registration, and a
thread that hands CUDA event completions back to the event loop.

Registration (``cudaHostRegister``) page-locks memory tierd allocated itself (a shared
mapping), instead of ``torch.empty(pin_memory=True)``, which rounds sizes up to a power of
two. Large ranges register in chunks so progress can be logged; every chunk must be
unregistered before the memory is unmapped.

:class:`EventWaiter` waits for events on one thread, in order. Events recorded on one
stream complete in order, so one waiter per stream never waits behind a later event; the
waiting thread sleeps in ``cudaEventSynchronize`` (events are created with
``blocking=True``) and wakes the loop with ``call_soon_threadsafe``: no polling, no
spinning on the loop.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from typing import Any, Protocol

import torch

from tierd.logs import get_logger

__all__ = [
    "CudaCallError",
    "EventWaiter",
    "HOST_REGISTER_PORTABLE",
    "cuda_available",
    "cuda_unavailable_reason",
    "host_register",
    "host_unregister",
]

log = get_logger(__name__)

# cudaHostRegisterPortable: the pages count as pinned in every CUDA context.
HOST_REGISTER_PORTABLE = 1


class CudaCallError(RuntimeError):
    """A CUDA runtime call returned an error code."""

    def __init__(self, call: str, code: int) -> None:
        super().__init__(f"{call} failed: {_error_string(code)} ({code})")
        self.call = call
        self.code = code


def cuda_available() -> bool:
    """Whether torch has CUDA and at least one device is visible."""
    return bool(torch.cuda.is_available())


def cuda_unavailable_reason() -> str | None:
    """Why CUDA cannot be used, or ``None`` when it can."""
    if torch.version.cuda is None:
        return "torch was built without CUDA"
    if not torch.cuda.is_available():
        return "no CUDA device is visible"
    return None


def _cudart() -> Any:
    # torch.cuda.cudart is untyped; it returns the _cudart extension module.
    return torch.cuda.cudart()  # type: ignore[no-untyped-call]


def _error_string(code: int) -> str:
    try:
        cudart = _cudart()
        return str(cudart.cudaGetErrorString(cudart.cudaError(code)))
    except (AttributeError, RuntimeError, ValueError):
        return "CUDA error"


def host_register(
    address: int,
    nbytes: int,
    *,
    chunk_bytes: int,
    progress: Callable[[int, int], None] | None = None,
) -> list[int]:
    """Page-lock ``[address, address + nbytes)`` in chunks of ``chunk_bytes``.

    Returns the base address of every registered chunk (pass them to
    :func:`host_unregister`). On failure the chunks already registered are unregistered
    and :class:`CudaCallError` is raised. ``progress(done, total)`` is called per chunk.
    """
    cudart = _cudart()
    chunks: list[int] = []
    done = 0
    while done < nbytes:
        size = min(chunk_bytes, nbytes - done)
        code = int(cudart.cudaHostRegister(address + done, size, HOST_REGISTER_PORTABLE))
        if code != 0:
            host_unregister(chunks)
            raise CudaCallError("cudaHostRegister", code)
        chunks.append(address + done)
        done += size
        if progress is not None:
            progress(done, nbytes)
    return chunks


def host_unregister(chunks: list[int]) -> None:
    """Unregister chunks from :func:`host_unregister`; raises :class:`CudaCallError` for
    the first failure after trying them all."""
    cudart = _cudart()
    first: CudaCallError | None = None
    for address in chunks:
        code = int(cudart.cudaHostUnregister(address))
        if code != 0 and first is None:
            first = CudaCallError("cudaHostUnregister", code)
    chunks.clear()
    if first is not None:
        raise first


class Waitable(Protocol):
    """What :class:`EventWaiter` waits for: a CUDA event, or a test fake."""

    def synchronize(self) -> None: ...


_Item = tuple[Waitable, asyncio.AbstractEventLoop, "asyncio.Future[None]"]


class EventWaiter:
    """One daemon thread that waits for events in submission order and resolves a future
    on the submitting loop for each."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._closed = False
        self._thread.start()

    def wait(self, event: Waitable) -> asyncio.Future[None]:
        """A future (of the running loop) that completes once ``event`` has."""
        if self._closed:
            raise RuntimeError("EventWaiter is closed")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        self._queue.put((event, loop, future))
        return future

    def close(self, timeout: float | None = None) -> None:
        """Finish the events already submitted, then stop the thread."""
        if not self._closed:
            self._closed = True
            self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            event, loop, future = item
            error: BaseException | None = None
            try:
                event.synchronize()
            except Exception as exc:  # handed to the awaiting coroutine, not lost
                error = exc
            try:
                loop.call_soon_threadsafe(_resolve, future, error)
            except RuntimeError:  # the loop is closed: nobody is waiting any more
                log.debug("a CUDA event completed after its loop closed")


def _resolve(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
