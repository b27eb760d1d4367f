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

from boostmpi.errors import UserError


class FilesystemError(UserError):
    """A path that cannot be created, written or read: a file where a folder is needed, no
    permission, a read-only filesystem, a full disk, a file-size limit."""


def format_bytes(n):
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{int(n)} B"


def _default_file_mode():
    umask = os.umask(0)  # reading the umask means setting it; put it straight back
    os.umask(umask)
    return 0o666 & ~umask


def fsync_dir(path):
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


@contextlib.contextmanager
def atomic_file(path, mode="w"):
    """Write `path` through a temporary file in the same folder, renamed over it once complete and
    on disk. On any error the temporary file is removed and the old `path` is left as it was."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp_path = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        os.fchmod(fd, _default_file_mode())  # mkstemp makes the file private; our outputs are shared data
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())  # the rename must never expose a file whose data is not on disk
        os.replace(tmp_path, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp_path)
        raise
    fsync_dir(folder)


def write_file_atomically(path, data):
    """Replace `path` with `data` (str or bytes) atomically."""
    with atomic_file(path, "wb" if isinstance(data, bytes) else "w") as f:
        f.write(data)


def write_at(fd, data, offset):
    """Write all of `data` (any C-contiguous buffer: bytes, a NumPy array) at byte `offset` of open file
    descriptor `fd`, however many calls the kernel needs; the GIL is released while the bytes are copied."""
    view = memoryview(data).cast("B")
    while view.nbytes:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def free_bytes(path):
    """Bytes this process may still write below `path` (its nearest existing folder), or None if unknown."""
    try:
        st = os.statvfs(_nearest_existing(path))
    except (OSError, AttributeError):
        return None
    return st.f_bavail * st.f_frsize


def file_size_limit():
    """The largest file this process may write (RLIMIT_FSIZE, `ulimit -f`), or None when unlimited."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    except (ImportError, OSError, ValueError):
        return None
    return None if soft == resource.RLIM_INFINITY else int(soft)


def is_out_of_space(exc):
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def _reason(exc):
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


def fs_error(exc, doing, path=None, needed=None):
    """A FilesystemError for `exc` (an OSError) met while `doing` (e.g. "cannot write checkpoint")."""
    path = path or getattr(exc, "filename", None)
    where = f" {path}" if path else ""
    message = f"{doing}{where}: {_reason(exc)}"
    if needed is not None and is_out_of_space(exc):
        free = free_bytes(path or ".")
        message += f"; it needs {format_bytes(needed)}" + (f", {format_bytes(free)} free" if free is not None else "")
    return FilesystemError(message)


def check_space(folder, needed, doing, largest_file=0):
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


def _nearest_existing(path):
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def _read_only(path):
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):
        return False


def check_dir_creatable(path, what):
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


def make_dirs(path, what):
    """os.makedirs(path, exist_ok=True), or a one-line error naming `what` (e.g. "train.run_dir") and why."""
    check_dir_creatable(path, what)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise fs_error(exc, f"cannot create {what}", path) from exc
    return path


def check_writable_parent(path, what):
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
