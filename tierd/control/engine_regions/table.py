"""One connection's engine regions: a registered descriptor (:class:`Region`), held open
while a job uses it, and the connection's table of them (:class:`RegionTable`), at most
:data:`MAX_REGIONS`. What a region is and what a job does with it:
:mod:`tierd.control.engine_regions.requests`."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from tierd.control.engine_regions.byte_moves import RegionNotSealable, map_for_loads, unmap
from tierd.control.protocol import ErrorCode
from tierd.errors import ProtocolError

__all__ = ["MAX_REGIONS", "Region", "RegionTable"]

MAX_REGIONS = 4  # per connection: an engine registers one, a few ranks share a process


class Region:
    """One registered descriptor: ``size`` bytes of an engine's memory. ``fd`` stays open
    while a job uses it, until :meth:`close` and the last job both happened."""

    def __init__(self, region_id: int, fd: int, size: int) -> None:
        self.id = region_id
        self.fd = fd
        self.size = size
        self.jobs = 0
        self.closing = False
        self._mapped: int | None = None  # its address here, sealed, once a load came

    def for_loads(self) -> int:
        """The region mapped here and sealed for loads (on the first one): its address.
        Refused ``bad_request``, saying why, for a file that cannot be sealed."""
        if self.closing:
            raise ProtocolError(f"region {self.id} is closed", code=ErrorCode.UNKNOWN_REGION)
        if self._mapped is None:
            try:
                self._mapped = map_for_loads(self.fd, self.size)
            except RegionNotSealable as exc:
                raise ProtocolError(
                    f"region {self.id}: {exc.strerror}", code=ErrorCode.BAD_REQUEST
                ) from None
        return self._mapped

    @contextmanager
    def job(self) -> Iterator[int]:
        """The descriptor, held open for the block."""
        if self.closing:
            raise ProtocolError(f"region {self.id} is closed", code=ErrorCode.UNKNOWN_REGION)
        self.jobs += 1
        try:
            yield self.fd
        finally:
            self.jobs -= 1
            self._close_if_done()

    def close(self) -> None:
        self.closing = True
        self._close_if_done()

    def _close_if_done(self) -> None:
        if self.closing and not self.jobs and self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)
            if self._mapped is not None:
                address, self._mapped = self._mapped, None
                unmap(address, self.size)


class RegionTable:
    """One connection's regions, by id."""

    def __init__(self) -> None:
        self.regions: dict[int, Region] = {}
        self._next = 0
        self.closed = False

    def check_room(self) -> None:
        if self.closed:
            raise ProtocolError("the connection closed", code=ErrorCode.SHUTTING_DOWN)
        if len(self.regions) >= MAX_REGIONS:
            raise ProtocolError(
                f"a connection may register at most {MAX_REGIONS} regions",
                code=ErrorCode.CAPACITY,
            )

    def add(self, fd: int, size: int) -> Region:
        self.check_room()
        self._next += 1
        region = self.regions[self._next] = Region(self._next, fd, size)
        return region

    def named(self, region_id: int) -> Region:
        region = self.regions.get(region_id)
        if region is None:
            raise ProtocolError(
                f"region {region_id} is not a region of this connection",
                code=ErrorCode.UNKNOWN_REGION,
            )
        return region

    def remove(self, region_id: int) -> None:
        self.named(region_id)
        self.regions.pop(region_id).close()

    def close(self) -> None:
        """The connection is gone: close every region (each after its last job)."""
        self.closed = True
        for region in self.regions.values():
            region.close()
        self.regions.clear()
