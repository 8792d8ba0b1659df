"""Block buffers: what a store accepts as a batch's bytes, checked before any byte moves.

This module owns the forms a batch may take (one ``[n, block_bytes]`` uint8 tensor or numpy
array, per-block flat device tensors, per-block flat host memoryviews), their validation
(:class:`~tierd.errors.SlotError` for a wrong count, size, dtype, layout or a read-only
target) and the zero-copy views over host tensors. It knows torch only through
``sys.modules``: a process that never imported torch holds no tensor, so importing it never
loads torch. Every name is re-exported from :mod:`tierd.stores.base`.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeAlias, cast

import numpy as np

from tierd.errors import SlotError

if TYPE_CHECKING:  # torch is the GPU extra's: only the GPU tier imports it
    import torch

__all__ = [
    "BlockBatch",
    "Buffer",
    "PoolRows",
    "block_array",
    "block_batch",
    "block_tensor",
    "block_views",
    "device_rows",
    "is_tensor",
    "slot_run_start",
    "tensor_memoryview",
]

# A block's bytes: anything exposing a contiguous buffer of exactly block_bytes
# (bytes, bytearray, memoryview, numpy array) or a uint8 torch tensor of block_bytes
# elements on any device.
Buffer = Any

# A validated batch: one [n, block_bytes] tensor or numpy array, per-block flat tensors (at
# least one on a device), or per-block flat host memoryviews.
BlockBatch: TypeAlias = (
    "torch.Tensor | np.ndarray[Any, Any] | list[torch.Tensor] | list[memoryview]"
)


class PoolRows(list):  # type: ignore[type-arg]
    """Per-block flat uint8 host tensors that a pool made of its own slots (rows of one
    ``[n, block_bytes]`` tensor): valid by construction, so a batch of them is checked
    for its count and block size only, not row by row."""

    __slots__ = ("block_bytes",)

    def __init__(self, rows: list[torch.Tensor], block_bytes: int) -> None:
        super().__init__(rows)
        self.block_bytes = block_bytes


def is_tensor(obj: Any) -> bool:
    """Whether ``obj`` is a torch tensor, without importing torch: a process that never
    imported torch holds no tensor (the daemon and the CPU, disk and remote tiers do not
    need torch; only the GPU tier and callers that hand tensors in do)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def block_batch(
    data: Any, count: int, block_bytes: int, *, writable: bool, host_rows: bool = False
) -> BlockBatch:
    """Validate a whole batch before any byte moves (:class:`SlotError` otherwise) and say
    which of the three forms it takes. ``host_rows``: per-block host tensors stay tensors
    (the GPU store copies each with one DMA) rather than becoming memoryviews."""
    whole = block_tensor(data, count, block_bytes)
    if whole is not None:
        return whole
    if isinstance(data, np.ndarray) and data.ndim == 2:
        return block_array(data, count, block_bytes, writable=writable)
    rows = device_rows(data, count, block_bytes, host_too=host_rows)
    if rows is not None:
        return rows
    return block_views(data, count, block_bytes, writable=writable)


def block_tensor(data: Any, count: int, block_bytes: int) -> torch.Tensor | None:
    """``data`` itself if it is a uint8 tensor of shape ``[count, block_bytes]`` (any
    device, any strides); ``None`` if it is not a tensor; :class:`SlotError` for a tensor
    of the wrong dtype or shape."""
    if not is_tensor(data):
        return None
    if str(data.dtype) != "torch.uint8":
        raise SlotError(f"block tensor must be uint8, got {data.dtype}")
    if tuple(data.shape) != (count, block_bytes):
        raise SlotError(
            f"block tensor must have shape [{count}, {block_bytes}], got {list(data.shape)}"
        )
    return cast("torch.Tensor", data)


def block_array(
    data: np.ndarray[Any, Any], count: int, block_bytes: int, *, writable: bool
) -> np.ndarray[Any, Any]:
    """A ``[count, block_bytes]`` uint8 numpy array (a host pool's rows, say: one copy
    moves them all), validated; :class:`SlotError` otherwise."""
    if data.dtype != np.uint8 or data.shape != (count, block_bytes):
        raise SlotError(
            f"a block array must be uint8 of shape [{count}, {block_bytes}],"
            f" got {data.dtype} {list(data.shape)}"
        )
    if writable and not data.flags.writeable:
        raise SlotError("cannot read into a read-only array")
    return data


def block_views(
    data: Sequence[Buffer] | Any, count: int, block_bytes: int, *, writable: bool
) -> list[memoryview]:
    """One flat byte memoryview per block, validated before any byte moves.

    ``data`` is a ``[count, block_bytes]`` uint8 host tensor or a sequence of ``count``
    buffers (bytes-like objects with 1-byte items, or uint8 host tensors of
    ``block_bytes`` elements). Device tensors are refused: they have no host address.
    Raises :class:`SlotError` for a wrong count, size, dtype, layout or, when
    ``writable``, a read-only buffer.
    """
    if (whole := block_tensor(data, count, block_bytes)) is not None:
        data = list(whole)
    try:
        given = len(data)
    except TypeError as exc:
        raise SlotError(
            f"block data must be a tensor or a sequence, not {type(data).__name__}"
        ) from exc
    if given != count:
        raise SlotError(f"{count} slots but {given} buffers")
    return [_block_view(item, block_bytes, writable) for item in data]


def _block_view(item: Any, block_bytes: int, writable: bool) -> memoryview:
    if is_tensor(item):
        if str(item.dtype) != "torch.uint8":
            raise SlotError(f"block tensor must be uint8, got {item.dtype}")
        if item.device.type != "cpu":
            raise SlotError(f"a per-block buffer must be in host memory, not on {item.device}")
        if not item.is_contiguous():
            raise SlotError("a per-block tensor must be contiguous")
        view = tensor_memoryview(item)
    else:
        try:
            view = memoryview(item)
        except TypeError as exc:
            raise SlotError(f"{type(item).__name__} is not a buffer") from exc
        if view.itemsize != 1 or not view.c_contiguous:
            raise SlotError("a block buffer must be C-contiguous with 1-byte items")
        view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
    if view.nbytes != block_bytes:
        raise SlotError(f"block buffer holds {view.nbytes} bytes, the store needs {block_bytes}")
    if writable and view.readonly:
        raise SlotError(f"cannot read into a read-only {type(item).__name__}")
    return view


def device_rows(
    data: Any, count: int, block_bytes: int, *, host_too: bool = False
) -> list[torch.Tensor] | None:
    """For a sequence of per-block tensors of which at least one lives on a device (GPU
    slot views, say), or with ``host_too`` a sequence of tensors only (a pinned pool's
    slot views): each block as a flat uint8 tensor, validated; else ``None`` (use
    :func:`block_tensor` / :func:`block_views`)."""
    if is_tensor(data) or not isinstance(data, Sequence) or not data:
        return None
    if host_too and isinstance(data, PoolRows):
        if len(data) != count or data.block_bytes != block_bytes:
            raise SlotError(
                f"{count} slots of {block_bytes} bytes but {len(data)} rows of {data.block_bytes}"
            )
        return data
    on_device = any(is_tensor(item) and item.device.type != "cpu" for item in data)
    if not on_device and not (host_too and all(is_tensor(item) for item in data)):
        return None
    if len(data) != count:
        raise SlotError(f"{count} slots but {len(data)} buffers")
    rows = []
    for item in data:
        if not is_tensor(item):
            raise SlotError("cannot mix device tensors with other buffers in one batch")
        if str(item.dtype) != "torch.uint8" or item.numel() != block_bytes:
            raise SlotError(f"a block tensor must be uint8 with {block_bytes} elements")
        if not item.is_contiguous():
            raise SlotError("a per-block tensor must be contiguous")
        rows.append(item.view(-1))
    return rows


def tensor_memoryview(tensor: torch.Tensor) -> memoryview:
    """A writable flat byte memoryview over a contiguous host tensor, zero-copy; the view
    keeps the tensor (and so its storage) alive."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise SlotError("only a contiguous host tensor has a memoryview")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(bytearray())
    array = (ctypes.c_char * nbytes).from_address(tensor.data_ptr())
    array._tierd_owner = tensor  # type: ignore[attr-defined]  # keep the storage alive
    return memoryview(array).cast("B")


def slot_run_start(slots: Sequence[int]) -> int | None:
    """The first slot if ``slots`` are consecutive ascending (one slice copy serves them
    all), else ``None``."""
    if not slots:
        return None
    first = slots[0]
    for offset, slot in enumerate(slots):
        if slot != first + offset:
            return None
    return first
