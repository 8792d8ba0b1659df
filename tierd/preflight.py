"""Checks of a config against this machine, made before anything is allocated.

``tierd serve`` and ``tierd config check`` refuse a config whose tiers cannot fit:

- a disk tier's slab files must fit the free space of their file systems; a slab file of
  the same tier already there is reused, so only its growth counts;
- a disk tier's directory must be a directory (or be creatable: see
  :func:`directories_to_create`), the daemon's user's own, and neither readable nor
  writable by its group or others (it is created 0700); the daemon must be able to write
  it (or the parent it is created in, or the slab file already there): a read-only file
  system stops root too; so must ``trace.directory``
  (:func:`private_directory_problem`, which the trace recorder asks again at
  ``tierd record on``);
- the CPU tiers' shared-memory pools (memfds, not files in ``/dev/shm``) and memory
  tiers must fit the memory available (``MemAvailable``);
- a GPU tier on a CUDA device needs torch installed and a CUDA driver that sees that
  device (asked of the driver itself, ``libcuda``, without loading torch).

With tenants, each tenant's slab (in ``<directory>/<tenant>/``, of its quota) is checked;
the slabs of one tier in one directory are counted together, and a problem of a
directory is named once.

Each problem is a :class:`~tierd.errors.ConfigError` line naming the tier, the directory,
the size asked and the space free.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tierd.cgroups import cgroup_memory_left
from tierd.config import ChainConfig, DaemonConfig, TierConfig, TierKind
from tierd.errors import ConfigError
from tierd.stores.disk.io import round_up
from tierd.stores.disk.slab import SLAB_FILE, slab_file_bytes
from tierd.units import format_bytes

__all__ = ["CUDA_LIBRARY", "check_machine", "directories_to_create", "private_directory_problem"]

CUDA_LIBRARY = "libcuda.so.1"  # the driver's library: present wherever CUDA can run


@dataclass(frozen=True, slots=True)
class _Slab:
    index: int  # the tier's index in the config
    tier: TierConfig
    directory: Path  # as configured (a tenant's slab is in a subdirectory of it)
    file: Path  # the slab file
    size: int


def check_machine(cfg: ChainConfig, *, meminfo: str = "/proc/meminfo") -> None:
    """:class:`ConfigError` listing every tier that does not fit this machine."""
    problems = _disk_problems(cfg) + _memory_problems(cfg, meminfo) + _gpu_problems(cfg)
    problems += _trace_problems(cfg)
    if problems:
        raise ConfigError("\n".join(dict.fromkeys(problems)))  # each named once


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
    needs: dict[tuple[int, Path], list[_Slab]] = {}  # a tier's slabs in one directory
    for slab in _slabs(cfg):
        problem = _directory_problem(slab)
        if problem is None:
            needs.setdefault((slab.index, slab.directory), []).append(slab)
        else:
            problems.append(problem)
    claimed: dict[int, int] = {}  # file system (st_dev) -> bytes the slabs before need
    for (index, directory), slabs in needs.items():
        anchor = _existing_ancestor(directory)
        size = sum(slab.size for slab in slabs)
        growth = max(sum(slab.size - _allocated(slab.file) for slab in slabs), 0)
        fs = os.statvfs(anchor)
        device = os.stat(anchor).st_dev
        free, before = fs.f_bavail * fs.f_frsize, claimed.get(device, 0)
        claimed[device] = before + growth
        if growth > free - before:
            whose = f" ({len(slabs)} tenants' slabs)" if len(slabs) > 1 else ""
            taken = (
                f", {format_bytes(before)} of it needed by the tiers checked before"
                if before
                else ""
            )
            problems.append(
                f"tiers.{index}.capacity: the disk tier {slabs[0].tier.name!r} needs"
                f" {format_bytes(size)} in {directory}{whose}, but its file system has"
                f" {format_bytes(free)} free{taken}{_reused(size - growth)} (lower the"
                " capacity, or choose another directory)"
            )
    return problems


def _directory_problem(slab: _Slab) -> str | None:
    """Why ``slab``'s directory cannot hold it (missing mount point, another user's,
    readable by others), or ``None``."""
    where = f"tiers.{slab.index}.directories"
    name = f"disk tier {slab.tier.name!r}"
    anchor = _existing_ancestor(slab.directory)
    if not anchor.is_dir():
        return f"{where}: {anchor} is not a directory ({name})"
    loose = private_directory_problem(slab.directory)
    if loose is not None:
        return f"{where}: {loose} ({name})"
    if not _creatable(slab.directory, anchor):
        return (
            f"{where}: {slab.directory.parent} does not exist ({name}; create it, or"
            " mount the drive it stands for)"
        )
    return _write_problem(slab, where, name)


def _write_problem(slab: _Slab, where: str, name: str) -> str | None:
    """Why the daemon cannot write ``slab`` where it goes, or ``None``: the slab file when
    it is there, else the nearest existing directory on the way to it (where the missing
    ones would be created)."""
    target = _existing_ancestor(slab.file)
    wanted = os.R_OK | os.W_OK if target.is_file() else os.W_OK | os.X_OK
    if os.access(target, wanted, effective_ids=os.access in os.supports_effective_ids):
        return None
    if os.statvfs(target).f_flag & os.ST_RDONLY:
        why = "its file system is mounted read-only"
    else:
        st = os.stat(target)
        why = f"permission denied (mode {stat.S_IMODE(st.st_mode):o}, owner uid {st.st_uid})"
    return f"{where}: the daemon cannot write {target} ({name}): {why}"


def _trace_problems(cfg: ChainConfig) -> list[str]:
    """``trace.directory`` holds every tenant's lookups: it is checked as a disk tier's."""
    directory = cfg.trace.directory if isinstance(cfg, DaemonConfig) else None
    if directory is None:
        return []
    if directory.exists() and not directory.is_dir():
        return [f"trace.directory: {directory} is not a directory"]
    problem = private_directory_problem(directory)
    return [] if problem is None else [f"trace.directory: {problem}"]


def private_directory_problem(directory: Path) -> str | None:
    """Why an existing directory may not hold blocks or traces: it is named through a
    link another user owns, another user owns it, or its group or others may read or
    write it (KV-cache blocks and recorded lookups reveal the prompts they came from; the
    way ssh refuses a key file others can read). ``None`` when it is private, or missing
    (it is then created 0700)."""
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


# -- GPU tiers ---------------------------------------------------------------------------


def _gpu_problems(cfg: ChainConfig) -> list[str]:
    """A GPU tier on ``cuda`` or ``cuda:N`` needs torch and a device N that the CUDA
    driver sees; ``device: cpu`` (development) needs neither."""
    wanted = [
        (index, tier)
        for index, tier in enumerate(cfg.tiers)
        if tier.kind is TierKind.GPU and (tier.device or "").startswith("cuda")
    ]
    if not wanted:
        return []
    problems = []
    if importlib.util.find_spec("torch") is None:
        problems += [
            f"tiers.{index}.kind: the gpu tier {tier.name!r} needs torch, which is not"
            " installed (pip install 'tierd[gpu]')"
            for index, tier in wanted
        ]
    count, why = _cuda_devices()
    for index, tier in wanted:
        device = tier.device or "cuda"
        number = int(device.partition(":")[2] or 0)
        if count is None:
            problems.append(
                f"tiers.{index}.device: the gpu tier {tier.name!r} asks for {device}, but"
                f" this machine cannot run CUDA ({why}); use device: cpu to test the"
                " config here, or check it with --offline for the machine it is meant for"
            )
        elif number >= count:
            problems.append(
                f"tiers.{index}.device: the gpu tier {tier.name!r} asks for {device}, but"
                f" the CUDA driver sees {count} device(s) (cuda:0 to cuda:{count - 1})"
            )
    return problems


def _cuda_devices() -> tuple[int | None, str]:
    """How many CUDA devices the driver sees, or ``None`` and why not."""
    try:
        driver = ctypes.CDLL(CUDA_LIBRARY)
    except OSError:
        return None, f"no CUDA driver: {CUDA_LIBRARY} is not installed"
    status = driver.cuInit(0)
    if status != 0:
        return None, f"the CUDA driver fails to start (cuInit error {status}): no usable GPU"
    count = ctypes.c_int(0)
    status = driver.cuDeviceGetCount(ctypes.byref(count))
    if status != 0:
        return None, f"the CUDA driver cannot count its devices (error {status})"
    if count.value == 0:
        return None, "the CUDA driver sees no device"
    return count.value, ""
