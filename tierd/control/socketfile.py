"""The socket file: binding it safely, and who is at the other end.

- :func:`bind_unix_socket` creates the socket file with its final mode and no window in
  which it is more open (bound inside a fresh 0700 directory, chmod-ed, then renamed into
  place). A socket file left by a crashed daemon (nobody accepts on it) is replaced; a
  live one is an error, "already running".
- :func:`peer_credentials` reads ``SO_PEERCRED``: the pid, uid and gid of the peer.
- :func:`socket_path_setting` reads the daemon's ``socket.path`` from the environment
  (``TIERD_SOCKET__PATH``), so that client commands find the daemon that variable moved.
- :func:`prepare_socket_directory` makes sure nobody else controls the directory the
  socket goes in (:func:`check_directory`, also used for the pid file's): it must belong
  to this user (or root), be writable by others only with the sticky bit, and be
  writable by everyone only when it is this user's own (so /tmp only for root). The
  default per-user directory is created, with only the access the socket's mode gives
  others.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import stat
import struct
from collections.abc import Mapping
from pathlib import Path

from tierd.errors import AlreadyRunning
from tierd.logs import get_logger

__all__ = [
    "CONFIG_ENV",
    "SOCKET_PATH_ENV",
    "bind_path_bytes",
    "bind_unix_socket",
    "check_directory",
    "default_socket_path",
    "peer_credentials",
    "prepare_socket_directory",
    "socket_path_setting",
]

log = get_logger("tierd.control")

_CREDS = struct.Struct("3i")  # struct ucred: pid, uid, gid
# Where a client finds the daemon: the environment variable naming its config file (whose
# ``socket.path`` it reads), else the default path. Here, not with the config models, so
# that client commands find the daemon without importing them.
CONFIG_ENV = "TIERD_CONFIG"
# The daemon's ``socket.path`` setting as a variable (tierd.settings: ``TIERD_`` then the
# path's segments joined by ``__``, in any case), which moves the daemon's socket.
SOCKET_PATH_ENV = "TIERD_SOCKET__PATH"


def default_socket_path(environ: Mapping[str, str] | None = None) -> Path:
    """``$XDG_RUNTIME_DIR/tierd/tierd.sock`` when that is set, else
    ``/tmp/tierd-<uid>/tierd.sock``: in a directory of this user's own, which the daemon
    creates 0700 and refuses when another user owns it (socket squatting)."""
    runtime = (os.environ if environ is None else environ).get("XDG_RUNTIME_DIR")
    directory = Path(runtime) / "tierd" if runtime else Path(f"/tmp/tierd-{os.getuid()}")
    return directory / "tierd.sock"


def socket_path_setting(environ: Mapping[str, str] | None = None) -> str | None:
    """The socket ``TIERD_SOCKET__PATH`` gives the daemon, or None when no such variable
    is set (or it is empty). The name's segments match in any case, as the daemon's
    settings read them; of several spellings, the last in sorted order wins there too."""
    env = os.environ if environ is None else environ
    prefix = "TIERD_"
    names = sorted(
        name
        for name in env
        if name.startswith(prefix) and name.removeprefix(prefix).lower() == "socket__path"
    )
    value = env[names[-1]].strip() if names else ""
    return value or None


_BIND_PREFIX = ".tierd-bind-"
_BIND_NAME = "sock"
_RANDOM_CHARS = 8  # what mkdtemp adds to the prefix


def bind_path_bytes(path: str) -> int:
    """The length of the path actually bound for ``path`` (in a fresh directory beside
    it, then renamed): what must fit ``sun_path``, not only ``path`` itself."""
    directory = os.fsencode(os.path.dirname(os.path.abspath(path)))
    return len(directory) + len(f"/{_BIND_PREFIX}/{_BIND_NAME}") + _RANDOM_CHARS


def bind_unix_socket(path: str, mode: int) -> socket.socket:
    """A listening Unix stream socket at ``path`` with permissions ``mode``."""
    import tempfile  # the daemon's alone: a client command, which imports this module, never binds

    _clear_stale(path)
    directory = os.path.dirname(os.path.abspath(path))
    private = tempfile.mkdtemp(prefix=_BIND_PREFIX, dir=directory)  # mode 0700
    staged = os.path.join(private, _BIND_NAME)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(staged)
        os.chmod(staged, mode)
        # Listen before the path appears: a connect in between would be refused, and a
        # daemon starting at that moment would take the socket for a stale one.
        sock.listen(1024)
        os.rename(staged, path)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(staged)
        raise
    finally:
        os.rmdir(private)
    return sock


def _clear_stale(path: str) -> None:
    """Remove a socket file nobody listens on; refuse to touch a live one or a non-socket."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise AlreadyRunning(f"{path} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError as exc:
        if exc.errno not in (errno.ECONNREFUSED, errno.ENOENT):
            raise
        log.warning("replacing a stale socket left by an earlier run", path=path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    else:
        raise AlreadyRunning(f"tierd is already running on {path}")
    finally:
        probe.close()


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the process at the other end of a Unix socket."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDS.size)
    pid, uid, gid = _CREDS.unpack(raw)
    return pid, uid, gid


def prepare_socket_directory(directory: str, *, create: bool, socket_mode: int) -> None:
    """Create ``directory`` when missing and ``create`` (mode 0700, plus search
    permission for the group or others when ``socket_mode`` lets them connect), then
    refuse it (:class:`PermissionError`, saying why) when another user owns it or may
    replace the socket in it."""
    if create:
        search = (0o050 if socket_mode & 0o060 else 0) | (0o005 if socket_mode & 0o006 else 0)
        with contextlib.suppress(FileExistsError):
            os.mkdir(directory, 0o700 | search)
            os.chmod(directory, 0o700 | search)  # past the umask
    check_directory(directory, "socket")


def check_directory(directory: str, what: str) -> None:
    """Refuse (:class:`PermissionError`, saying why) a directory the daemon writes in
    (``what``: the socket's, the pid file's) that another user owns or may replace files
    in: writable by its group or others without the sticky bit, or writable by everyone
    and not the daemon's own (``/tmp`` for any daemon but root's)."""
    st = os.lstat(directory)
    if not stat.S_ISDIR(st.st_mode):
        raise PermissionError(f"the {what} directory {directory} is not a directory")
    me = os.geteuid()
    if st.st_uid not in (me, 0):
        raise PermissionError(
            f"the {what} directory {directory} belongs to uid {st.st_uid}, not to this user"
            f" (uid {me}): another user may be squatting it; remove it, or set socket.path"
        )
    loose = st.st_mode & 0o022
    mode = stat.S_IMODE(st.st_mode)
    if loose and not st.st_mode & stat.S_ISVTX:
        raise PermissionError(
            f"the {what} directory {directory} is writable by"
            f" {'others' if loose & 0o002 else 'its group'} (mode {mode:o}),"
            " who could replace the socket: chmod go-w it, or set socket.path"
        )
    if loose & 0o002 and st.st_uid != me:
        raise PermissionError(
            f"the {what} directory {directory} is writable by everyone (mode {mode:o}) and"
            f" belongs to uid {st.st_uid}, not to this user (uid {me}): anyone may plant"
            " files there; use a directory of this user's own, or set socket.path"
        )
