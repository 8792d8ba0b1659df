"""Scalar values of the config files: sizes, permission modes, durations.

Each parser takes what YAML gives (an int, a float or a string) and returns a plain value
or raises ``ValueError`` with what is allowed; :mod:`tierd.config` wraps them into
pydantic field types.
"""

from __future__ import annotations

import math
import re

__all__ = [
    "MAX_BLOCKS",
    "capacity_parts",
    "format_bytes",
    "parse_block_size",
    "parse_mode",
    "parse_seconds",
    "parse_size",
    "share_parts",
]

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


MAX_SIZE = 1 << 62  # any size past this is a typo, and would overflow a C off_t


def parse_size(value: object) -> int:
    """Bytes from ``4096``, ``"4096"``, ``"64GiB"``, ``"1.5 GB"``; raises ``ValueError``."""
    if isinstance(value, bool):
        raise ValueError("a size must be a number of bytes or a string like '64GiB'")
    if isinstance(value, int):
        if value < 0:
            raise ValueError("a size cannot be negative")
        if value > MAX_SIZE:
            raise ValueError("a size must be at most 4 EiB (2**62 bytes)")
        return value
    if isinstance(value, str):
        if value.strip().startswith("-") and _SIZE.match(value.strip()[1:]):
            raise ValueError("a size cannot be negative")
        match = _SIZE.match(value)
        unit = match.group(2).lower() if match else None
        if match and unit in _UNITS:
            size = float(match.group(1)) * _UNITS[unit]
            if not math.isfinite(size) or size > MAX_SIZE:
                raise ValueError("a size must be at most 4 EiB (2**62 bytes)")
            return int(size)
    raise ValueError(f"{value!r} is not a size (use bytes or a unit: KiB MiB GiB TiB KB MB GB TB)")


def parse_block_size(value: object) -> int:
    """A block size: :func:`parse_size`, but a decimal unit (``256kb`` is 256,000 bytes,
    not 256 KiB) is refused with both readings, since a block size in powers of 1000 is
    almost always a KiB or MiB meant; a plain number of bytes is taken as it is."""
    size = parse_size(value)
    match = _SIZE.match(value) if isinstance(value, str) else None
    unit = match.group(2).lower() if match else ""
    if unit in ("kb", "mb", "gb", "tb"):
        binary = f"{match.group(1) if match else ''}{unit[0].upper()}iB"
        raise ValueError(
            f"{str(value).strip()!r} is {size:,} bytes (KB MB GB TB count in 1000s): a block "
            f"size in {unit[0].upper()}iB is written {binary!r}; {size} (bytes) if 1000s are meant"
        )
    return size


MAX_BLOCKS = 1 << 40  # per tier: past any machine's memory for the index


def capacity_parts(value: int | str) -> tuple[int, bool]:
    """``(count, is_bytes)`` for a capacity: a block count (``4096``, ``"4096 blocks"``)
    or a size (``"64GiB"``); raises ``ValueError``."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value <= 0:
            raise ValueError("capacity must be positive")
        if value > MAX_BLOCKS:
            raise ValueError(f"capacity is at most {MAX_BLOCKS:,} blocks (2**40)")
        return value, False
    if isinstance(value, str):
        text = value.strip().lower()
        if text.startswith("-"):
            raise ValueError("capacity must be positive")
        if text.endswith("blocks"):
            count = text.removesuffix("blocks").strip()
            if count.isdigit() and 0 < len(count) <= 12 and 0 < int(count) <= MAX_BLOCKS:
                return int(count), False
        else:
            return parse_size(value), True
    raise ValueError(f"capacity {value!r} is not a block count or a size like '64GiB'")


_SHARE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*%\s*$")


def share_parts(value: int | str) -> tuple[float, bool]:
    """``(amount, is_share)``: ``"25%"`` gives ``(0.25, True)``, a block count (``12``,
    ``"12 blocks"``) gives ``(12.0, False)``; anything else (a size too) raises
    ``ValueError``."""
    if isinstance(value, str) and (match := _SHARE.match(value)) is not None:
        share = float(match.group(1)) / 100
        if not 0 < share <= 1:
            raise ValueError(f"a share must be more than 0% and at most 100%, got {value!r}")
        return share, True
    count, is_bytes = capacity_parts(value)
    if is_bytes:
        raise ValueError(f"{value!r} is a size: give a block count or a share like '50%'")
    return float(count), False


_OWNER_RW = 0o600


def parse_mode(value: object) -> int:
    """A permission mode from an int (``0o600``, ``384``) or an octal string (``"0600"``,
    ``"0o600"``, ``"600"``) that keeps owner read/write; raises ``ValueError``."""
    if isinstance(value, str):
        digits = value.strip().lower().removeprefix("0o")
        if not digits or any(c not in "01234567" for c in digits):
            raise ValueError("not an octal mode: write it like 0o600 or '0600'")
        value = int(digits, 8)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError("mode must be an octal number like 0o600 or a string like '0600'")
    if not 0 <= value <= 0o777:
        raise ValueError("mode must be within 0..0o777 (octal: write 0o600, not 600)")
    if value & _OWNER_RW != _OWNER_RW:
        raise ValueError("mode must include owner read/write (0o600)")
    return value


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def parse_seconds(value: object) -> float:
    """Seconds (0 or more) from ``10``, ``2.5``, ``"10s"``, ``"500ms"``, ``"2m"``, ``"1h"``;
    raises ``ValueError``. A field that needs more than 0 says so itself (``gt=0``)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str) and (match := _DURATION.match(value.lower())):
        seconds = float(match.group(1)) * _SECONDS[match.group(2)]
    elif isinstance(value, str) and _DURATION.match(value.lower().strip().removeprefix("-")):
        raise ValueError("a duration must be 0 or more")
    else:
        raise ValueError("not a duration: use seconds, or a string like '10s', '500ms', '2m'")
    if not (math.isfinite(seconds) and seconds >= 0):
        raise ValueError("a duration must be 0 or more, and finite")
    return seconds


def format_bytes(size: int) -> str:
    """``1.5 GiB``, ``512 MiB``, ``1 PiB``."""
    value = float(size)
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024:
            return f"{value:.0f} {unit}" if unit == "bytes" else f"{value:.3g} {unit}"
        value /= 1024
    return f"{value:.3g} PiB"
