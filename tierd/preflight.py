"""Checks of a config against this machine, made before anything is allocated.

``tierd serve`` and ``tierd config check`` refuse a config whose tiers cannot fit:

- a disk tier's slab files must fit the free space of their file systems; a slab file of
  the same tier already there is reused, so only its growth counts;
- a disk tier's directory must be a directory (or be creatable: see
  :func:`directories_to_create`), the daemon's user's own, and neither readable nor
  writable by its group or others (it is created 0700);
- the CPU tiers' shared-memory pools (memfds, not files in ``/dev/shm``) and memory
  tiers must fit the memory available (``MemAvailable``).

With tenants, each tenant's slab (in ``<directory>/<tenant>/``, of its quota) is checked.

Each problem is a :class:`~tierd.errors.ConfigError` line naming the tier, the directory,
the size asked and the space free.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tierd.config import ChainConfig, DaemonConfig, TierConfig, TierKind
from tierd.errors import ConfigError
from tierd.stores.disk_slab import SLAB_FILE, slab_file_bytes
from tierd.stores.fileio import round_up
from tierd.units import format_bytes

__all__ = ["check_machine", "directories_to_create"]


@dataclass(frozen=True, slots=True)
class _Slab:
    index: int  # the tier's index in the config
    tier: TierConfig
    directory: Path  # as configured (a tenant's slab is in a subdirectory of it)
    file: Path  # the slab file
    size: int


def check_machine(cfg: ChainConfig, *, meminfo: str = "/proc/meminfo") -> None:
    """:class:`ConfigError` listing every tier that does not fit this machine."""
    problems = _disk_problems(cfg) + _memory_problems(cfg, meminfo)
    if problems:
        raise ConfigError("\n".join(problems))


def directories_to_create(cfg: ChainConfig, home: Path | None = None) -> list[Path]:
    """The missing directories that opening ``cfg``'s disk tiers needs, parents first.

    A tier's own directory is created when its parent exists; missing parents are created
    only inside the home directory (``~/.local/state/tierd`` on a fresh account) or the
    XDG state directory, never elsewhere: a missing mount point must fail rather than fill
    the root file system."""
    home = Path.home() if home is None else home
    missing: list[Path] = []
    for tier in cfg.tiers:
        for directory in tier.directories:
            path = directory.absolute()
            chain = [path] if path.parent.is_dir() else _missing_parents(path, home)
            missing += [p for p in chain if not p.exists() and p not in missing]
    return missing


# -- disk tiers --------------------------------------------------------------------------


def _slabs(cfg: ChainConfig) -> Iterator[_Slab]:
    """Every slab file the config's disk tiers use: with tenants, one per tenant in a
    subdirectory of each configured directory, of the tenant's quota."""
    parts = cfg.tenant_chains() if isinstance(cfg, DaemonConfig) else [(None, cfg)]
    for _, part in parts:
        for index, tier in enumerate(part.tiers):
            if tier.kind is not TierKind.DISK:
                continue
            blocks, count = tier.num_blocks(cfg.block_bytes), len(tier.directories)
            configured = cfg.tiers[index]
            for i, directory in enumerate(tier.directories):
                size = slab_file_bytes(len(range(i, blocks, count)), cfg.block_bytes)
                yield _Slab(
                    index, configured, configured.directories[i], directory / SLAB_FILE, size
                )


def _disk_problems(cfg: ChainConfig) -> list[str]:
    problems = []
    claimed: dict[int, int] = {}  # file system (st_dev) -> bytes the slabs before need
    for slab in _slabs(cfg):
        where = f"tiers.{slab.index}.directories"
        name = f"disk tier {slab.tier.name!r}"
        anchor = _existing_ancestor(slab.directory)
        if not anchor.is_dir():
            problems.append(f"{where}: {anchor} is not a directory ({name})")
            continue
        loose = _loose(slab.directory)
        if loose is not None:
            problems.append(f"{where}: {loose} ({name})")
            continue
        if not _creatable(slab.directory, anchor):
            problems.append(
                f"{where}: {slab.directory.parent} does not exist ({name}; create it, or"
                " mount the drive it stands for)"
            )
            continue
        growth = slab.size - _allocated(slab.file)
        fs = os.statvfs(anchor)
        device = os.stat(anchor).st_dev
        free = fs.f_bavail * fs.f_frsize - claimed.get(device, 0)
        claimed[device] = claimed.get(device, 0) + max(growth, 0)
        if growth > free:
            problems.append(
                f"tiers.{slab.index}.capacity: the {name} needs {format_bytes(slab.size)} in"
                f" {slab.file.parent}, but its file system has {format_bytes(max(free, 0))}"
                f" free{_reused(slab.size - growth)} (lower the capacity, or choose another"
                " directory)"
            )
    return problems


def _loose(directory: Path) -> str | None:
    """Why an existing disk directory may not hold blocks: another user owns it, or its
    group or others may read or write it (KV-cache blocks reveal the prompts they came
    from; the way ssh refuses a key file others can read). ``None`` when it is private,
    or missing (it is then created 0700)."""
    link = _foreign_link(directory)
    if link is not None:
        return link
    try:
        st = os.stat(directory)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode):
        return None  # named by the checks that follow
    if st.st_uid != os.geteuid():
        return (
            f"{directory} belongs to uid {st.st_uid}, not to the daemon's user"
            f" (uid {os.geteuid()}): use a directory of the daemon's own"
        )
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o066:
        who = (
            "its group and others"
            if mode & 0o060 and mode & 0o006
            else ("its group" if mode & 0o060 else "others")
        )
        return (
            f"{directory} can be read or written by {who} (mode {mode:o}): the blocks"
            f" in it reveal the prompts they came from; chmod 700 {directory}"
        )
    return None


def _foreign_link(directory: Path) -> str | None:
    """Why a disk directory named through a link of another user may not hold blocks:
    that user can point it elsewhere after these checks (at a directory of theirs where
    the slab's name links to a file of the daemon's). ``None`` when every link on the
    way belongs to the daemon's user or root."""
    me = os.geteuid()
    path = Path(os.path.abspath(directory))
    for step in [*reversed(path.parents), path]:
        try:
            st = os.lstat(step)
        except OSError:
            return None  # missing from here on: created by the daemon, 0700
        if stat.S_ISLNK(st.st_mode) and st.st_uid not in (me, 0):
            return (
                f"{directory} is named through the link {step}, which uid {st.st_uid} owns"
                f" and may point elsewhere: name the real directory"
                f" ({os.path.realpath(directory)})"
            )
    return None


def _reused(existing: int) -> str:
    return f" (besides the {format_bytes(existing)} of its slab file)" if existing > 0 else ""


def _allocated(path: Path) -> int:
    """The bytes a file already takes on its device (0 when it does not exist)."""
    try:
        return os.stat(path).st_blocks * 512
    except OSError:
        return 0


def _existing_ancestor(path: Path) -> Path:
    """The nearest of ``path`` and its parents that exists: a directory, or the file in
    the way (``/`` always exists)."""
    for candidate in (path, *path.absolute().parents):
        if candidate.exists():
            return candidate
    return Path("/")


def _own_roots(home: Path) -> list[Path]:
    """Where missing parents may be created: the user's home, and the XDG state directory
    the default config names (which may lie outside it)."""
    state = os.environ.get("XDG_STATE_HOME", "")
    return [home, Path(state)] if os.path.isabs(state) else [home]


def _creatable(directory: Path, anchor: Path) -> bool:
    """Whether :func:`directories_to_create` would create ``directory`` below ``anchor``."""
    path = directory.absolute()
    if path == anchor or path.parent == anchor:
        return True
    return any(path.is_relative_to(root) for root in _own_roots(Path.home()))


def _missing_parents(path: Path, home: Path) -> list[Path]:
    if not any(path.is_relative_to(root) for root in _own_roots(home)):
        return []
    chain = [path]
    while not chain[-1].parent.exists():
        chain.append(chain[-1].parent)
    return list(reversed(chain))


# -- memory tiers ------------------------------------------------------------------------


def _memory_problems(cfg: ChainConfig, meminfo: str) -> list[str]:
    """CPU pools are memfds (not files in /dev/shm, whatever its size) and memory tiers
    plain memory: together they must fit what the kernel says is available."""
    sizes = {
        index: tier.num_blocks(cfg.block_bytes) * round_up(cfg.block_bytes)
        for index, tier in enumerate(cfg.tiers)
        if tier.kind in (TierKind.CPU, TierKind.MEMORY)
    }
    available = _mem_available(meminfo)
    source = "MemAvailable"
    limited = cgroup_memory_left()
    if limited is not None and (available is None or limited[0] < available):
        available, source = limited
    if not sizes or available is None:
        return []
    problems = []
    memory_left = available
    for index, size in sizes.items():
        tier = cfg.tiers[index]
        if size > memory_left:
            problems.append(
                f"tiers.{index}.capacity: the {tier.kind} tier {tier.name!r} needs"
                f" {format_bytes(size)} of memory, but {format_bytes(memory_left)} is"
                f" available ({source}; lower the capacity)"
            )
        memory_left = max(memory_left - size, 0)
    return problems


def _mem_available(meminfo: str) -> int | None:
    """``MemAvailable`` in bytes, or ``None`` where the kernel does not report it."""
    try:
        with open(meminfo) as lines:
            for line in lines:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


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
