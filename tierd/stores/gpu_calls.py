"""The GPU store's helpers: which exceptions are CUDA failures (any torch version), the
error a lost device raises, and the CUDA calls that order a launch, kept as module-level
seams that tests on a machine without a GPU replace with recording fakes.

torch is the GPU extra's: this module, like :mod:`tierd.stores.gpu`, is imported only for a
GPU tier.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import torch

from tierd.errors import StoreIOError
from tierd.stores.base import BlockBatch

__all__ = [
    "DeviceLost",
    "bind",
    "current_stream",
    "device_scope",
    "host_pinned",
    "is_device_error",
    "is_sticky",
    "set_device",
    "stream_scope",
    "within",
]

# torch.AcceleratorError exists from torch 2.8; before, a CUDA error is a RuntimeError
# whose message names CUDA (and the tier supports torch >= 2.3).
_ACCELERATOR_ERROR: type[Exception] = getattr(torch, "AcceleratorError", RuntimeError)


def is_device_error(exc: BaseException) -> bool:
    """Whether ``exc`` is a CUDA failure (any torch version), not a bug of ours."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    if _ACCELERATOR_ERROR is not RuntimeError and isinstance(exc, _ACCELERATOR_ERROR):
        return True
    return isinstance(exc, RuntimeError) and "CUDA" in str(exc)


def is_sticky(exc: BaseException) -> bool:
    """Whether ``exc`` leaves the CUDA context unusable (every later call fails the same
    way): anything but running out of memory."""
    return is_device_error(exc) and not isinstance(exc, torch.OutOfMemoryError)


class DeviceLost(StoreIOError):
    """The GPU store saw a sticky CUDA error or a hung copy: it refuses every operation."""


async def within(future: asyncio.Future[None], seconds: float) -> None:
    """``future``, or :class:`TimeoutError` after ``seconds`` (the future is left to its
    thread: it resolves when the device answers, if ever)."""
    done, _ = await asyncio.wait((future,), timeout=seconds)
    if not done:
        raise TimeoutError
    future.result()


def bind(fn: Callable[..., Any], *args: Any) -> Callable[[], Any]:
    return lambda: fn(*args)


def set_device(index: int) -> Callable[[], None]:
    """Set ``index`` as the calling thread's device (for the event threads, at start)."""
    return lambda: torch.cuda.set_device(index)


# The CUDA calls that order a launch, as seams: tests on a machine without a GPU replace
# them with recording fakes to check which stream waits for which, on which thread.
def current_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.current_stream(device)


def device_scope(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    return torch.cuda.device(device)


def stream_scope(stream: torch.cuda.Stream) -> contextlib.AbstractContextManager[Any]:
    return torch.cuda.stream(stream)


def host_pinned(batch: BlockBatch) -> bool:
    """Whether the host side of ``batch`` is page-locked (device tensors and memoryviews,
    which are packed into pinned staging, count as pinned)."""
    if isinstance(batch, torch.Tensor):
        return batch.device.type != "cpu" or bool(batch.is_pinned())
    if batch and isinstance(batch[0], torch.Tensor):
        row = batch[0]
        return row.device.type != "cpu" or bool(row.is_pinned())
    return True
