"""Writing files safely, and filesystem errors as one-line messages.

`atomic_file` is the one way boostmpi replaces a file: the bytes go to a temporary file in the
same folder, are flushed and fsynced, and the temporary file is renamed over the target (and the
folder fsynced), so a reader or a crash sees the old file or the new one, never half of one.
`fs_error` turns an OSError into a UserError (exit status 2) that says what was being done, to
which path, and why, in one line; "no space left" also says how much space was needed.
"""

import contextlib
import errno
import os
import tempfile
import threading
from contextlib import AbstractContextManager
from typing import BinaryIO, Iterator, Literal, NoReturn, TextIO, cast, overload

from boostmpi.arrays import Array
from boostmpi.errors import UserError

StrPath = str | os.PathLike[str]  # a path as callers hold it: text or a pathlib.Path


class FilesystemError(UserError):
    """A path that cannot be created, written or read: a file where a folder is needed, no
    permission, a read-only filesystem, a full disk, a file-size limit."""


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{int(n)} B"


def _default_file_mode() -> int:
    umask = os.umask(0)  # reading the umask means setting it; put it straight back
    os.umask(umask)
    return 0o666 & ~umask


def fsync_dir(path: StrPath) -> None:
    """Make a rename or a new entry in folder `path` durable (best effort: some filesystems refuse)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@overload
def atomic_file(path: StrPath, mode: Literal["w"] = "w") -> AbstractContextManager[TextIO]: ...
@overload
def atomic_file(path: StrPath, mode: Literal["wb"]) -> AbstractContextManager[BinaryIO]: ...


def atomic_file(path: StrPath, mode: str = "w") -> AbstractContextManager[TextIO | BinaryIO]:
    """Write `path` through a temporary file in the same folder, renamed over it once complete and
    on disk. On any error the temporary file is removed and the old `path` is left as it was.
    `mode`: "w" (text) or "wb" (bytes)."""
    return _atomic_file(path, mode)


@contextlib.contextmanager
def _atomic_file(path: StrPath, mode: str) -> Iterator[TextIO | BinaryIO]:
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp_path = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        os.fchmod(fd, _default_file_mode())  # mkstemp makes the file private; our outputs are shared data
        with os.fdopen(fd, mode) as f:
            yield cast("TextIO | BinaryIO", f)
            f.flush()
            os.fsync(f.fileno())  # the rename must never expose a file whose data is not on disk
        os.replace(tmp_path, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.remove(tmp_path)
        if isinstance(exc, OSError) and exc.filename is None:
            exc.filename = path  # a write() that failed names no file: name the one being written
        raise
    fsync_dir(folder)


def write_file_atomically(path: StrPath, data: str | bytes) -> None:
    """Replace `path` with `data` (str or bytes) atomically."""
    if isinstance(data, bytes):
        with atomic_file(path, "wb") as fb:
            fb.write(data)
        return
    with atomic_file(path) as f:
        f.write(data)


def write_at(fd: int, data: Array | bytes, offset: int) -> None:
    """Write all of `data` (any C-contiguous buffer: bytes, a NumPy array) at byte `offset` of open file
    descriptor `fd`, however many calls the kernel needs; the GIL is released while the bytes are copied."""
    view = memoryview(data).cast("B")
    while view.nbytes:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _write_all(fd: int, data: bytes) -> None:
    """os.write until all of `data` is written (a short write is not an error)."""
    view = memoryview(data)
    while view.nbytes:
        view = view[os.write(fd, view):]


class LineLog:
    """A file that only grows by whole lines (metrics.jsonl). Each line goes to the file with unbuffered
    writes, so nothing waits in a buffer to fail later; a line the filesystem refuses (a full disk, a
    quota, a file-size limit) is cut off again, the file still ends with its last whole line, and the
    refusal is a FilesystemError naming the file."""

    def __init__(self, path: StrPath) -> None:
        self.path = os.fspath(path)
        self.fd: int | None
        try:
            self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        except OSError as exc:
            raise fs_error(exc, "cannot open", self.path) from exc

    def append(self, line: str) -> None:
        assert self.fd is not None, f"{self.path} is closed"
        end = os.lseek(self.fd, 0, os.SEEK_END)
        try:
            _write_all(self.fd, line.encode())
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.ftruncate(self.fd, end)
            raise fs_error(exc, "cannot append to", self.path) from exc

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def free_bytes(path: StrPath) -> int | None:
    """Bytes this process may still write below `path` (its nearest existing folder), or None if unknown."""
    try:
        st = os.statvfs(_nearest_existing(path))
    except (OSError, AttributeError):
        return None
    return st.f_bavail * st.f_frsize


def file_size_limit() -> int | None:
    """The largest file this process may write (RLIMIT_FSIZE, `ulimit -f`), or None when unlimited."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    except (ImportError, OSError, ValueError):
        return None
    return None if soft == resource.RLIM_INFINITY else int(soft)


def is_out_of_space(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def _reason(exc: OSError) -> str:
    """Why an OSError happened, in words (HDF5 and others sometimes give no errno)."""
    if exc.errno == errno.ENOTDIR:
        return "a part of the path is a file, not a folder"
    if exc.errno == errno.EEXIST:
        return "a file of that name already exists"
    if exc.errno == errno.EFBIG:
        return "the file-size limit was reached (ulimit -f)"
    if exc.errno == errno.EDQUOT:
        return "the disk quota is exceeded"
    return (exc.strerror or str(exc)).rstrip(".").lower()


def fs_error(exc: OSError, doing: str, path: StrPath | None = None, needed: int | None = None) -> "FilesystemError":
    """A FilesystemError for `exc` (an OSError) met while `doing` (e.g. "cannot write checkpoint")."""
    path = path or getattr(exc, "filename", None)
    where = f" {path}" if path else ""
    message = f"{doing}{where}: {_reason(exc)}"
    if needed is not None and is_out_of_space(exc):
        free = free_bytes(path or ".")
        message += f"; it needs {format_bytes(needed)}" + (f", {format_bytes(free)} free" if free is not None else "")
    return FilesystemError(message)


def check_space(folder: StrPath, needed: int, doing: str, largest_file: int = 0) -> None:
    """Refuse before writing `needed` bytes below `folder` (the largest file `largest_file` bytes)
    when the disk, or the file-size limit, has less room."""
    free = free_bytes(folder)
    if free is not None and needed > free:
        raise FilesystemError(f"{doing} {folder}: no space left on device; it needs {format_bytes(needed)}, "
                              f"{format_bytes(free)} free")
    limit = file_size_limit()
    if limit is not None and largest_file > limit:
        raise FilesystemError(f"{doing} {folder}: a file of {format_bytes(largest_file)} exceeds this process's "
                              f"file-size limit of {format_bytes(limit)} (ulimit -f)")


def _nearest_existing(path: StrPath) -> str:
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def _read_only(path: StrPath) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):
        return False


def check_dir_creatable(path: StrPath, what: str) -> str:
    """Refuse, without creating anything, a folder `path` that cannot be made or written: a file of
    that name, a file above it, a folder without write permission, a read-only filesystem."""
    path = os.fspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise FilesystemError(f"{what} {path} is a file, not a folder")
    base = _nearest_existing(path)
    if not os.path.isdir(base):
        raise FilesystemError(f"{what} {path} cannot be created: {base} is a file, not a folder")
    if _read_only(base):
        raise FilesystemError(f"{what} {path} is on a read-only filesystem ({base})")
    if not os.access(base, os.W_OK | os.X_OK):
        raise FilesystemError(f"{what} {path} cannot be written: permission denied on {base}")
    return path


def make_dirs(path: StrPath, what: str) -> StrPath:
    """os.makedirs(path, exist_ok=True), or a one-line error naming `what` (e.g. "train.run_dir") and why."""
    check_dir_creatable(path, what)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise fs_error(exc, f"cannot create {what}", path) from exc
    return path


def check_writable_parent(path: StrPath, what: str) -> str:
    """Refuse an output file whose folder is missing, is a file, or is not writable; `path` must not be a folder."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise FilesystemError(f"{what} {path} is a folder; give a file name")
    parent = os.path.dirname(os.path.abspath(path))
    base = _nearest_existing(parent)
    if not os.path.isdir(base):
        raise FilesystemError(f"{what} {path}: {base} is a file, not a folder")
    if base != parent:
        raise FilesystemError(f"{what} {path}: the folder {parent} does not exist")
    check_dir_creatable(parent, f"{what} {path}: the folder")
    return path


# ---------------------------------------------------------------- one run per run directory

LOCK_NAME = ".lock"
LEASE_S = 120.0  # without OS locks: a holder on another host that has not renewed its lease for this long is gone
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class RunDirInUse(FilesystemError):
    """Another live run holds the run directory."""


def _holder_text(path: StrPath) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(4096).decode("utf-8", "replace").strip()
    except OSError:
        return ""


def _describe_holder(text: str) -> str:
    import json

    try:
        h = json.loads(text)
        return f"host {h['host']}, pid {h['pid']}, started {h['started']}"
    except (ValueError, KeyError, TypeError):
        return "a holder that left no record" if not text else f"a holder recorded as {text[:80]!r}"


def pid_alive(pid: object) -> bool:
    """Whether process `pid` (a holder record's field, of whatever type the record holds) lives here."""
    if not isinstance(pid, (int, float, str)):
        return True  # a record we cannot read: assume alive
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, TypeError, OverflowError):
        return True  # someone else's live process, or a record we cannot read: assume alive
    return True


def renew_lease(path: StrPath, thread_name: str) -> threading.Event:
    """Touch `path` every LEASE_S / 4 seconds from a daemon thread, so that other hosts see its holder
    alive; returns the Event that stops it."""
    import threading

    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(LEASE_S / 4):
            with contextlib.suppress(OSError):
                os.utime(path)

    threading.Thread(target=renew, name=thread_name, daemon=True).start()
    return stop


class RunLock:
    """Held by one process (rank 0) for a run's life: `run_dir/.lock`, an OS lock (flock) on a file that
    records its holder (host, pid, start time). The kernel (or, on a network filesystem, the file
    server) drops the lock when its holder dies, however it dies: a second run on a live run directory
    is refused naming the holder, and a record left by a dead holder is reported as stale and taken
    over. Where the filesystem has no locks, the record is a lease renewed every LEASE_S / 4 seconds:
    on the same host a dead pid frees it at once, from another host a lease older than LEASE_S."""

    def __init__(self, run_dir: StrPath, what: str = "train.run_dir") -> None:
        import json
        import socket
        import time

        self.path = os.path.join(os.fspath(run_dir), LOCK_NAME)
        self.what, self.run_dir = what, os.fspath(run_dir)
        self.host = socket.gethostname()
        self.record = json.dumps({"host": self.host, "pid": os.getpid(),
                                  "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())})
        self.stale: str | None = None  # the record of a dead holder this lock replaced, in words
        self._file: BinaryIO | None = None
        self._lease: threading.Event | None = None

    def acquire(self) -> "RunLock":
        """Take the lock or raise RunDirInUse naming its holder. Returns self."""
        try:
            self._acquire()
        except OSError as exc:
            raise fs_error(exc, f"cannot lock {self.what}", self.path) from exc
        return self

    def _acquire(self) -> None:
        import fcntl

        while True:
            f = open(self.path, "a+b")
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.close()
                self._refuse(_holder_text(self.path))
            except OSError as exc:
                f.close()
                if exc.errno not in _NO_LOCKS:
                    raise
                return self._acquire_lease()
            try:  # a holder that released (and removed the file) between our open and our lock: try again
                same = os.path.samestat(os.fstat(f.fileno()), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                break
            f.close()
        f.seek(0)
        previous = f.read(4096).decode("utf-8", "replace").strip()
        if previous:
            self.stale = _describe_holder(previous)
        f.seek(0)
        f.truncate()
        f.write(self.record.encode() + b"\n")
        f.flush()
        self._file = f

    def _refuse(self, text: str) -> NoReturn:
        raise RunDirInUse(f"{self.what} {self.run_dir} is in use by another run ({_describe_holder(text)}; lock file "
                          f"{self.path}): wait for it to end or stop it, or choose another {self.what}")

    def _acquire_lease(self) -> None:
        import json
        import time

        text = _holder_text(self.path)
        if text:
            try:
                holder = json.loads(text)
                same_host = holder.get("host") == self.host
                alive = pid_alive(holder.get("pid")) if same_host else \
                    time.time() - os.stat(self.path).st_mtime < LEASE_S
            except (ValueError, AttributeError, OSError):
                alive = False
            if alive:
                self._refuse(text)
            self.stale = _describe_holder(text)
        write_file_atomically(self.path, self.record + "\n")
        self._lease = renew_lease(self.path, "boostmpi-run-lease")

    def release(self) -> None:
        """Remove the record and drop the lock (the record is removed while the lock is still held)."""
        if self._file is None and self._lease is None:
            return
        with contextlib.suppress(OSError):
            os.remove(self.path)
        if self._lease is not None:
            self._lease.set()
            self._lease = None
        if self._file is not None:
            self._file.close()
            self._file = None
