"""Readers and pruning of one checkpoint folder: a reader pins the folder for the whole of its read, and
pruning (`[checkpoint] keep`) never takes a pinned folder (docs/OPERATIONS.md, "During a live run").

A pin is a file `.reader-<host>-<pid>-<token>.pin` in the checkpoint folder recording its holder (host,
pid, time), renewed (its modification time) every LEASE_S / 4 seconds while the read goes on. It is
live while it is younger than LEASE_S and, on the holder's own host, while the holder's pid exists; a
pin left by a killed reader is stale and ignored. No OS lock is involved: parallel filesystems often
make `flock` node-local, while a file and its modification time are seen by every node.

Pruning a folder and pinning it are told apart by the two flags each side writes before it looks at the
other's (Dekker's order): the pruner first writes its claim `.pruning` into the folder and then looks
for live pins (one found: it withdraws the claim and keeps the folder); a reader first writes its pin
and then looks for a claim (one found: it withdraws its pin and waits until the claim is withdrawn or
the folder is gone). Whichever comes second sees the other's flag, so a folder is never renamed away
while a reader holds it. A reader does not rely on the pin alone: it opens every file before reading
(reading.HeldCheckpoint), so even a folder removed by hand cannot turn into NaN.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import time
from typing import TYPE_CHECKING, Literal, cast

from boostmpi.errors import CheckpointError
from boostmpi.files import LEASE_S, pid_alive, renew_lease

if TYPE_CHECKING:
    import threading
    from typing import Self

PIN_PREFIX, PIN_SUFFIX = ".reader-", ".pin"
CLAIM = ".pruning"
CLAIM_S = 10.0  # a claim older than this was left by a pruner that died between writing it and renaming


class CheckpointGone(CheckpointError):
    """The checkpoint folder was pruned before a reader could pin it."""


def _record() -> str:
    return json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                       "time": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())})


def _live(path: str, max_age: float) -> bool:
    """Whether the flag file at `path` (a pin or a claim) belongs to a live holder."""
    try:
        age = time.time() - os.stat(path).st_mtime
        with open(path) as f:
            holder = json.loads(f.read(4096))
    except OSError:
        return False  # gone
    except ValueError:
        holder = None  # being written (its holder created it an instant ago), or damaged
    if age > max_age:
        return False
    if not isinstance(holder, dict):
        return True  # a young flag whose record is not readable yet counts as live
    return holder.get("host") != socket.gethostname() or pid_alive(holder.get("pid"))


def live_pins(folder: str) -> list[str]:
    """The file names of the live reader pins in a checkpoint folder."""
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    return sorted(n for n in names if n.startswith(PIN_PREFIX) and n.endswith(PIN_SUFFIX)
                  and _live(os.path.join(folder, n), LEASE_S))


def _write_new(path: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, _record().encode() + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)


def claim_for_pruning(folder: str) -> bool:
    """The pruner's side: True when `folder` may be renamed away (the claim stays until it is), False when a
    live reader holds it (the claim is withdrawn)."""
    claim = os.path.join(folder, CLAIM)
    with contextlib.suppress(FileNotFoundError):
        os.remove(claim)  # a dead pruner's claim: this pruner is the only one of the run
    _write_new(claim)
    if live_pins(folder):
        with contextlib.suppress(OSError):
            os.remove(claim)
        return False
    return True


class Pin:
    """A reader's pin on a checkpoint folder (a context manager): while it is held, pruning keeps the
    folder. Raises CheckpointError when the folder is gone (pruned before the pin was taken)."""

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.folder = os.fspath(folder)
        token = os.urandom(4).hex()
        self.path: str | None = os.path.join(self.folder, f"{PIN_PREFIX}{socket.gethostname()}-{os.getpid()}-{token}{PIN_SUFFIX}")
        self._stop: threading.Event | None = None

    def _gone(self) -> CheckpointGone:
        return CheckpointGone(f"checkpoint {self.folder} was removed (pruned by its run, checkpoint.keep) before it "
                               f"could be read; name a newer checkpoint, or the run directory for its newest")

    def acquire(self) -> Self:
        claim = os.path.join(self.folder, CLAIM)
        path = cast(str, self.path)  # the constructor's: None only once a pin was given up
        while True:
            try:
                _write_new(path)
            except FileNotFoundError:
                raise self._gone() from None
            except OSError as exc:
                # a read-only copy of a checkpoint (nothing can prune it from here), or a full filesystem:
                # read unpinned; the reader still opens every file before reading, so a folder pruned
                # meanwhile still reads whole or is one line
                full = exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS)
                if full or (os.path.isdir(self.folder) and not os.access(self.folder, os.W_OK)):
                    self.path = None
                    return self
                raise CheckpointError(f"cannot pin {self.folder} for reading: {exc.strerror or exc}") from exc
            if not os.path.exists(claim):
                break
            with contextlib.suppress(OSError):
                os.remove(path)  # the pruner came first: let it decide
            while _live(claim, CLAIM_S):  # a pruner holds it for a moment: until it renames or withdraws
                time.sleep(0.02)
            if not os.path.isdir(self.folder):
                raise self._gone()
            if os.path.exists(claim) and not _live(claim, CLAIM_S):
                with contextlib.suppress(OSError):
                    os.remove(claim)  # left by a pruner that died before renaming the folder
        self._stop = renew_lease(path, "boostmpi-reader-pin")
        return self

    def release(self) -> None:
        if self._stop is not None:
            self._stop.set()
            self._stop = None
        if self.path is not None:
            with contextlib.suppress(OSError):
                os.remove(self.path)
            self.path = None

    def __enter__(self) -> Self:
        return self.acquire()

    def __exit__(self, *exc: object) -> Literal[False]:
        self.release()
        return False
