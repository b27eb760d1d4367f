"""Writing the files of a checkpoint: a rank file from its kept layout, either front to back through a
page-aligned staging buffer (SequentialWriter) or as a whole image in memory (the snapshot of an
asynchronous save), both with direct I/O where the filesystem allows it; the virtual files model.h5
and optim.h5; and the size and checksum of a written file once it is on disk."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Literal, TypeAlias

import numpy as np

from boostmpi.checkpoint.format import FORMAT, FORMAT_VERSION, Checksum, file_digest, fsync_file, rank_file_name
from boostmpi.checkpoint.layout import layout_key, rank_file_parts, rank_pieces, recall, remember
from boostmpi.files import write_at
from boostmpi.model.params import all_global_specs

if TYPE_CHECKING:
    import mmap
    from types import TracebackType
    from typing import Self

    from numpy.typing import DTypeLike

    from boostmpi.checkpoint.layout import RankState
    from boostmpi.config import Config
    from boostmpi.model.params import Piece

FileRecord: TypeAlias = dict[str, int | str]
"""What COMPLETE records of a file: {"bytes": its size, <checksum name>: its hex digest}."""


class _SpareImages:
    """Page-aligned buffers of written snapshots, kept for the next save of the same size: new memory
    costs a page fault per page on first touch (on some virtual machines as much as copying it)."""
    KEPT = 2
    buffers: list[mmap.mmap]

    def __init__(self) -> None:
        import threading

        self.lock, self.buffers = threading.Lock(), []

    def take(self, nbytes: int) -> mmap.mmap:
        import mmap

        with self.lock:
            for i, image in enumerate(self.buffers):
                if len(image) == nbytes:
                    return self.buffers.pop(i)
        return mmap.mmap(-1, nbytes)

    def give_back(self, image: mmap.mmap) -> None:
        with self.lock:
            self.buffers.append(image)
            while len(self.buffers) > self.KEPT:
                self.buffers.pop(0).close()


SPARE_IMAGES = _SpareImages()


def rank_file_image(path: str, cfg: Config, state: RankState) -> tuple[mmap.mmap, int]:
    """(image, size): the `size` bytes write_rank_file would write at `path`, in page-aligned memory of
    whole pages (an anonymous mmap; hand it to SPARE_IMAGES.give_back once written): the snapshot of
    an asynchronous save, written with direct I/O."""
    import mmap

    lo, flats, layout = rank_file_parts(path, cfg, state)
    image = SPARE_IMAGES.take(max(1, -(-layout.size // mmap.PAGESIZE)) * mmap.PAGESIZE)
    raw = np.frombuffer(image, np.uint8)
    for offset, blob in layout.structure:
        raw[offset:offset + len(blob)] = np.frombuffer(blob, np.uint8)
    for offset, group, p in layout.data:
        source = flats[group]
        np.frombuffer(image, source.dtype, p.size, offset).reshape(p.shape)[...] = p.take(source, lo)
    del raw
    return image, layout.size


def write_file_image(path: str, image: mmap.mmap, size: int) -> None:
    """Write the first `size` bytes of a page-aligned `image` of whole pages as file `path`, with direct
    I/O (O_DIRECT) where the filesystem allows it: the disk reads the memory itself, so neither a copy
    into the page cache nor the kernel's writeback of it competes with training for the CPU."""
    flags, direct = os.O_WRONLY | os.O_CREAT | os.O_TRUNC, getattr(os, "O_DIRECT", 0)
    if direct:
        try:
            fd = os.open(path, flags | direct, 0o666)
            try:
                write_at(fd, image, 0)  # whole pages from page-aligned memory: what direct I/O asks
                os.ftruncate(fd, size)
                return
            finally:
                os.close(fd)
        except OSError as exc:  # as in SequentialWriter: EINVAL, no direct I/O here; EFBIG, the limit
            if exc.errno not in (errno.EINVAL, errno.EFBIG):  # falls inside the last page's padding
                raise
    fd = os.open(path, flags, 0o666)
    try:
        write_at(fd, memoryview(image)[:size], 0)
    finally:
        os.close(fd)


class SequentialWriter:
    """A new file written front to back through a page-aligned staging buffer (one of SPARE_IMAGES), with
    direct I/O (O_DIRECT) where the filesystem allows it: a page-cache copy of gigabytes, and the
    kernel's writeback of it, cost more CPU than the disk's own transfer (a measured 3 s against 0.3 s
    for 1 GiB on the development VM). A filesystem that refuses direct I/O (EINVAL: tmpfs), or a
    file-size limit inside the last page's padding (EFBIG), gets ordinary writes instead. `digest` (a
    Checksum) is fed every byte in order. Use as a context manager; `position` is the bytes written."""
    STAGING = 32 << 20

    def __init__(self, path: str, digest: Checksum | None = None) -> None:
        import mmap

        self.path, self.digest, self.page = path, digest, mmap.PAGESIZE
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        self.direct, fd = hasattr(os, "O_DIRECT"), None
        if self.direct:
            try:
                fd = os.open(path, flags | os.O_DIRECT, 0o666)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self.direct = False
        if fd is None:
            fd = os.open(path, flags, 0o666)
        self.fd = fd
        self.buffer = SPARE_IMAGES.take(self.STAGING)
        self.staged = np.frombuffer(self.buffer, np.uint8)
        self.fill, self.position = 0, 0

    def write(self, data: bytes | np.ndarray) -> None:
        """Append `data` (bytes, or a C-contiguous NumPy array)."""
        src = np.frombuffer(data, np.uint8) if isinstance(data, bytes) else data.reshape(-1).view(np.uint8)
        while src.size:
            n = min(src.size, self.STAGING - self.fill)
            self.staged[self.fill:self.fill + n] = src[:n]
            self.fill, src = self.fill + n, src[n:]
            if self.fill == self.STAGING:
                self._flush()

    def _flush(self) -> None:
        if not self.fill:
            return
        chunk = memoryview(self.buffer)[:self.fill]
        if self.digest is not None:
            self.digest.update(chunk)
        try:
            if self.direct:
                pages = (self.fill + self.page - 1) // self.page
                try:  # whole pages; the padding past the end is cut off in `close`
                    write_at(self.fd, memoryview(self.buffer)[:pages * self.page], self.position)
                except OSError as exc:
                    if exc.errno not in (errno.EINVAL, errno.EFBIG):
                        raise
                    fd = os.open(self.path, os.O_WRONLY)  # before the old one is closed: one fd to close
                    os.close(self.fd)
                    self.fd, self.direct = fd, False
                    write_at(self.fd, chunk, self.position)
            else:
                write_at(self.fd, chunk, self.position)
        finally:
            chunk.release()
        self.position += self.fill
        self.fill = 0

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> Literal[False]:
        try:
            if kind is None:
                self._flush()
                # the padding of a direct write past the end (also one a file-size limit cut short
                # before the fallback rewrote its chunk) is cut off
                os.ftruncate(self.fd, self.position)
        finally:
            os.close(self.fd)
            del self.staged  # the view of the buffer, which could not be closed while it is exported
            SPARE_IMAGES.give_back(self.buffer)
        return False


def write_rank_file(path: str, cfg: Config, state: RankState, digest: Checksum | None = None) -> None:
    """One rank's file: `model/<name>/<i>`, `m/<name>/<i>`, `v/<name>/<i>` for each of its pieces,
    each dataset carrying its global box (attribute `box`); file attributes `format`, `coords`.
    `digest` (a Checksum) is fed the file's bytes in order as they are written."""
    lo, flats, layout = rank_file_parts(path, cfg, state)
    runs = sorted([(offset, blob) for offset, blob in layout.structure]
                  + [(offset, (group, p)) for offset, group, p in layout.data], key=lambda run: run[0])
    with SequentialWriter(path, digest) as out:
        for offset, what in runs:  # they cover the file, in order
            if offset != out.position + out.fill:
                raise RuntimeError(f"{path}: the rank file's layout has a gap or an overlap at byte {offset}")
            if isinstance(what, bytes):
                out.write(what)
            else:
                group, p = what
                out.write(np.ascontiguousarray(p.take(flats[group], lo)))


def write_virtual_files(folder: str, cfg: Config, step: int, adam_t: int, dtype: DTypeLike) -> None:
    """model.h5 and optim.h5: every global tensor as an HDF5 virtual dataset over the rank files, by
    relative file names (the folder can be moved or copied); the fill value NaN marks an element no
    source covers, which a complete checkpoint never has. Built by HDF5 once per layout; a later save
    writes the same bytes and sets its own `step` (and `t`)."""
    import h5py

    key = layout_key("virtual files", cfg, np.dtype(dtype).str)
    kept = recall(key)
    if isinstance(kept, dict):
        for file_name, blob in kept.items():
            with open(os.path.join(folder, file_name), "wb") as f:
                f.write(blob)
        with h5py.File(os.path.join(folder, "model.h5"), "r+") as f:
            f.attrs["step"] = int(step)
        with h5py.File(os.path.join(folder, "optim.h5"), "r+") as f:
            f.attrs["step"] = int(step)
            f.attrs["t"] = int(adam_t)
        return
    par = cfg.parallel
    layouts: dict[str, list[tuple[str, Piece]]] = {}
    for t in range(par.tp):
        for st in range(par.pp):
            for d in range(par.dp):
                source = rank_file_name(t, st, d)
                for p in rank_pieces(cfg, t, st, d)[2]:
                    layouts.setdefault(p.name, []).append((source, p))
    shapes = {s.name: s.global_shape for s in all_global_specs(cfg)}
    config_json = json.dumps(cfg.to_dict(), sort_keys=True)
    files = (("model.h5", ("model",), {"format": FORMAT, "format_version": FORMAT_VERSION, "step": int(step),
                                      "config": config_json}),
             ("optim.h5", ("m", "v"), {"format": FORMAT, "step": int(step), "t": int(adam_t)}))
    for file_name, groups, attrs in files:
        with h5py.File(os.path.join(folder, file_name), "w") as f:
            for k, v in attrs.items():
                f.attrs[k] = v
            for group in groups:
                for name, shape in shapes.items():
                    layout = h5py.VirtualLayout(shape=shape, dtype=dtype)
                    for source, p in layouts[name]:
                        layout[tuple(slice(a, b) for a, b in p.box)] = h5py.VirtualSource(
                            source, f"{group}/{p.key}", shape=p.shape)
                    target = name if group == "model" else f"{group}/{name}"
                    f.create_virtual_dataset(target, layout, fillvalue=np.nan)
    images: dict[str, bytes] = {}
    for file_name, _, _ in files:
        with open(os.path.join(folder, file_name), "rb") as f:
            images[file_name] = f.read()
    remember(key, images)


def file_record(path: str, phases: dict[str, float] | None = None, digest: Checksum | None = None) -> FileRecord:
    """Size and checksum of a written file, once it is fsynced; `phases` (a dict) adds the seconds of each.
    `digest`: the file's Checksum, already fed its bytes as they were written (nothing is read back).

    The hash runs in a thread while the fsync waits for the disk: the file's bytes are final before
    either starts (read back from the page cache), hashing is CPU work and both release the GIL, so
    the two overlap instead of adding up."""
    import threading

    if digest is not None:
        with PhaseTimer(phases)("fsync"):
            fsync_file(path)
        return {"bytes": os.path.getsize(path), Checksum.name: digest.hexdigest()}
    timer, value, error = PhaseTimer(phases), [], []

    def hash_it() -> None:
        try:
            with timer("checksum"):
                value.append(file_digest(path))
        except BaseException as exc:  # noqa: BLE001 - raised below, in the caller's thread
            error.append(exc)

    hasher = threading.Thread(target=hash_it, name="checkpoint-checksum")
    hasher.start()
    try:
        with timer("fsync"):
            fsync_file(path)
    finally:
        hasher.join()
    if error:
        raise error[0]
    return {"bytes": os.path.getsize(path), Checksum.name: value[0]}


class PhaseTimer:
    """`with timer(name):` adds the block's wall seconds to `phases[name]` (nothing when phases is None)."""

    def __init__(self, phases: dict[str, float] | None) -> None:
        self.phases = phases

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            if self.phases is not None:
                self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - t
