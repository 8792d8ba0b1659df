"""Small CUDA helpers for the stores: availability, host-memory registration, and a
thread that hands CUDA event completions back to the event loop.

Registration (``cudaHostRegister``) page-locks memory tierd allocated itself (a shared
mapping), instead of ``torch.empty(pin_memory=True)``, which rounds sizes up to a power of
two. Large ranges register in chunks so progress can be logged and a stop can interrupt
it between chunks; every chunk must be unregistered before the memory is unmapped. A copy
must not cross two chunks (CUDA wants one registration per host range of a copy), so
:func:`split_at_boundaries` cuts runs of slots at the chunk edges. A failed registration
leaves the runtime's per-thread "last error" set, which the next unrelated kernel launch
on that thread would raise: it is cleared at once (:func:`clear_last_error`).

torch is the GPU extra's (``pip install 'tierd[gpu]'``): this module imports it only when
a CUDA call is made, and :func:`cuda_unavailable_reason` says so when it is missing.

:class:`EventWaiter` waits for events on one thread, in order. Events recorded on one
stream complete in order, so one waiter per stream never waits behind a later event; the
waiting thread sleeps in ``cudaEventSynchronize`` (events are created with
``blocking=True``) and wakes the loop with ``call_soon_threadsafe``: no polling, no
spinning on the loop.
"""

from __future__ import annotations

import asyncio
import ctypes
import importlib.util
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from tierd.logs import get_logger

__all__ = [
    "CudaCallError",
    "EventWaiter",
    "HOST_REGISTER_PORTABLE",
    "RegistrationStopped",
    "GPU_EXTRA",
    "clear_last_error",
    "cuda_available",
    "cuda_unavailable_reason",
    "host_register",
    "host_unregister",
    "split_at_boundaries",
    "torch_missing_reason",
]

log = get_logger(__name__)

# What to install for the GPU tier; quoted so that zsh and fish do not glob the brackets.
GPU_EXTRA = "pip install 'tierd[gpu]'"

# cudaHostRegisterPortable: the pages count as pinned in every CUDA context.
HOST_REGISTER_PORTABLE = 1


class RegistrationStopped(Exception):
    """Registration was asked to stop between two chunks; nothing stays registered."""

    def __init__(self, done: int, total: int) -> None:
        super().__init__(f"host registration stopped after {done:,} of {total:,} bytes")
        self.done = done
        self.total = total


class CudaCallError(RuntimeError):
    """A CUDA runtime call returned an error code."""

    def __init__(self, call: str, code: int, cudart: Any = None) -> None:
        super().__init__(f"{call} failed: {_error_string(code, cudart)} ({code})")
        self.call = call
        self.code = code


def torch_missing_reason() -> str | None:
    """Why torch cannot be imported (it is the GPU extra's), or ``None`` when it can."""
    if importlib.util.find_spec("torch") is None:
        return f"torch is not installed: the GPU tier needs it ({GPU_EXTRA})"
    return None


def cuda_available() -> bool:
    """Whether torch is installed, has CUDA and sees at least one device."""
    return cuda_unavailable_reason() is None


def cuda_unavailable_reason() -> str | None:
    """Why CUDA cannot be used, or ``None`` when it can (imports torch when installed)."""
    if (missing := torch_missing_reason()) is not None:
        return missing
    import torch

    if torch.version.cuda is None:
        return f"torch was built without CUDA (torch {torch.__version__}); install a CUDA build"
    if not torch.cuda.is_available():
        # is_available() says False for a driver too old as for no device: ask why.
        try:
            torch.cuda.init()  # type: ignore[no-untyped-call]
        except (RuntimeError, AssertionError) as exc:
            return f"CUDA cannot start: {exc}"
        return "no CUDA device is visible"
    return None


def _cudart() -> Any:
    import torch

    # torch.cuda.cudart is untyped; it returns the _cudart extension module.
    return torch.cuda.cudart()  # type: ignore[no-untyped-call]


def split_at_boundaries(slots: Sequence[int], boundary: int) -> list[tuple[int, int]]:
    """Cut ``slots`` into index ranges ``[start, stop)`` so that no run of consecutive
    ascending slots crosses a multiple of ``boundary`` (a registration chunk's edge, in
    slots): a run that would is cut where the next chunk begins. Non-consecutive slots
    are separate copies anyway and are not cut."""
    if boundary <= 0:
        raise ValueError(f"boundary must be positive, got {boundary}")
    pieces: list[tuple[int, int]] = []
    start = 0
    for i in range(1, len(slots)):
        if slots[i] == slots[i - 1] + 1 and slots[i] % boundary == 0:
            pieces.append((start, i))
            start = i
    if slots:
        pieces.append((start, len(slots)))
    return pieces


def clear_last_error(cudart: Any = None) -> None:
    """Reset the calling thread's CUDA "last error" after a failed runtime call, so the
    next unrelated launch on this thread does not raise it. torch's ``cudart`` module
    lacks ``cudaGetLastError`` in most versions: then the runtime library torch loaded is
    called through ctypes."""
    cudart = _cudart() if cudart is None else cudart
    if hasattr(cudart, "cudaGetLastError"):
        cudart.cudaGetLastError()
        return
    library = _runtime_library()
    if library is None:
        log.warning("cannot clear the CUDA last error: no CUDA runtime library is loaded")
        return
    library.cudaGetLastError()


def _runtime_library() -> ctypes.CDLL | None:
    """The CUDA runtime library this process loaded (dlopen of a loaded library returns
    the same handle), found in /proc/self/maps."""
    try:
        with open("/proc/self/maps", encoding="ascii", errors="replace") as maps:
            for line in maps:
                path = line.rsplit(" ", 1)[-1].strip()
                if "/libcudart" in path:
                    return ctypes.CDLL(path)
    except OSError:
        return None
    return None


def _error_string(code: int, cudart: Any = None) -> str:
    try:
        cudart = _cudart() if cudart is None else cudart
        return str(cudart.cudaGetErrorString(cudart.cudaError(code)))
    except (AttributeError, AssertionError, RuntimeError, ValueError):
        return "CUDA error"


def host_register(
    address: int,
    nbytes: int,
    *,
    chunk_bytes: int,
    progress: Callable[[int, int], None] | None = None,
    stop: threading.Event | None = None,
    cudart: Any = None,
) -> list[int]:
    """Page-lock ``[address, address + nbytes)`` in chunks of ``chunk_bytes``.

    Returns the base address of every registered chunk (pass them to
    :func:`host_unregister`). On failure the chunks already registered are unregistered
    and :class:`CudaCallError` is raised. ``progress(done, total)`` is called per chunk.
    ``stop`` set between two chunks (a SIGTERM during start-up) unregisters what was done
    and raises :class:`RegistrationStopped`: a chunk takes well under a second, a whole
    pool of 128 GiB about a minute. ``cudart``: the runtime binding (tests pass a fake).
    """
    cudart = _cudart() if cudart is None else cudart
    chunks: list[int] = []
    done = 0
    while done < nbytes:
        if stop is not None and stop.is_set():
            host_unregister(chunks, cudart=cudart)
            raise RegistrationStopped(done, nbytes)
        size = min(chunk_bytes, nbytes - done)
        code = int(cudart.cudaHostRegister(address + done, size, HOST_REGISTER_PORTABLE))
        if code != 0:
            clear_last_error(cudart)  # else the next launch on this thread raises it
            host_unregister(chunks, cudart=cudart)
            raise CudaCallError("cudaHostRegister", code, cudart)
        chunks.append(address + done)
        done += size
        if progress is not None:
            progress(done, nbytes)
    return chunks


def host_unregister(chunks: list[int], *, cudart: Any = None) -> None:
    """Unregister chunks from :func:`host_unregister`; raises :class:`CudaCallError` for
    the first failure after trying them all."""
    cudart = _cudart() if cudart is None else cudart
    first: CudaCallError | None = None
    for address in chunks:
        code = int(cudart.cudaHostUnregister(address))
        if code != 0 and first is None:
            clear_last_error(cudart)
            first = CudaCallError("cudaHostUnregister", code, cudart)
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

    def __init__(self, name: str, on_start: Callable[[], None] | None = None) -> None:
        """``on_start`` runs first on the thread: the GPU store sets its device there, or
        the thread's first CUDA call would make a context on GPU 0 whatever the tier's."""
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._on_start = on_start
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
        start_error: BaseException | None = None
        if self._on_start is not None:
            try:
                self._on_start()
            except Exception as exc:  # handed to every waiter below, not lost
                start_error = exc
        while (item := self._queue.get()) is not None:
            event, loop, future = item
            error: BaseException | None = start_error
            try:
                if error is None:
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
