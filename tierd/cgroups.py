"""How much memory this process's cgroups leave it (v1 and v2): a tier past it is
OOM-killed at start, whatever ``MemAvailable`` says, so :mod:`tierd.preflight` counts it."""

from __future__ import annotations

from pathlib import Path

from tierd.units import format_bytes

__all__ = ["cgroup_memory_left"]

_NO_LIMIT = 1 << 62  # cgroup v1 reports "no limit" as a huge page-rounded number


def cgroup_memory_left(
    proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup"
) -> tuple[int, str] | None:
    """The memory this process's cgroups leave it: the least, over its memory cgroup and
    every ancestor that has a limit, of the limit minus what the cgroup uses (v2's
    ``memory.max``/``memory.current``, v1's ``memory.limit_in_bytes``/``usage_in_bytes``),
    with the cgroup it comes from; ``None`` without a limit. A tier past it is OOM-killed
    at start, with nothing in the log, whatever ``MemAvailable`` says."""
    try:
        with open(proc_cgroup) as lines:
            entries = [line.rstrip("\n").split(":", 2) for line in lines]
    except OSError:
        return None
    for entry in entries:
        if len(entry) != 3:
            continue
        _, controllers, path = entry
        if controllers == "":
            found = _tightest(Path(root), path, "memory.max", "memory.current")
        elif "memory" in controllers.split(","):
            found = _tightest(
                Path(root) / "memory", path, "memory.limit_in_bytes", "memory.usage_in_bytes"
            )
        else:
            continue
        if found is not None:
            return found
    return None


def _tightest(mount: Path, path: str, limit_file: str, usage_file: str) -> tuple[int, str] | None:
    best: tuple[int, str] | None = None
    parts = [p for p in path.split("/") if p]
    for depth in range(len(parts), -1, -1):
        group = mount.joinpath(*parts[:depth])
        limit = _read_number(group / limit_file)
        if limit is None or limit >= _NO_LIMIT:
            continue
        left = max(limit - (_read_number(group / usage_file) or 0), 0)
        if best is None or left < best[0]:
            name = "/" + "/".join(parts[:depth])
            best = (left, f"the memory cgroup {name} is limited to {format_bytes(limit)}")
    return best


def _read_number(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit
