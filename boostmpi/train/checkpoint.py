"""Checkpoints: the one module that writes and reads model.h5, optim.h5, state.json (docs/CHECKPOINTS.md).

  <run_dir>/checkpoints/step_00000010/
      rank-tp<t>-pp<s>-dp<d>.h5   what each rank wrote: its pieces of the parameters and AdamW moments
      model.h5     global parameter tensors: virtual datasets over the rank files (plain h5py reads them)
      optim.h5     AdamW moments `m/<name>`, `v/<name>` as global tensors (virtual), attribute `t`
      state.json   step, data position, RNG seed, layout that wrote it
      COMPLETE     written last: sizes and XXH3-64 checksums of every file above
  <run_dir>/checkpoints/latest   the name of the newest complete checkpoint
  <run_dir>/checkpoints/abandoned-<time>/   checkpoints of a timeline a run did not continue

Writing (`save`, collective): every rank writes its own file at once into a hidden temporary folder;
rank 0 checks the free space first and, once every rank reported a complete file, writes the virtual
files, COMPLETE, renames the folder into place and replaces `latest` atomically. A crash at any point
leaves the previous checkpoint and `latest` untouched; a folder without COMPLETE is never loaded; a
write that fails on any rank (a full disk) removes its temporary folder and stops every rank with one
line; a killed writer's folder is removed when the next run starts. A checkpoint folder always holds
the state of the run that wrote it: one of another timeline is moved aside, never reused.

Reading (`load`): each rank reads only the hyperslabs of its own shards and optimizer slice, under any
layout. Nothing is pickled or executed on load.
"""

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import time

from typing import NamedTuple

import numpy as np

from boostmpi.errors import CheckpointError, UserError
from boostmpi.files import (FilesystemError, atomic_file, check_space, fs_error, fsync_dir, make_dirs, write_at,
                            write_file_atomically)
from boostmpi.model.params import FlatBuffer, all_global_specs, block_pieces, param_specs, split_range
from boostmpi.model.params import flat_blocks  # the FlatBuffer's layout from specs alone

FORMAT = "boostmpi"
FORMAT_VERSION = 1
MARKER = "COMPLETE"
FILES = ("model.h5", "optim.h5", "state.json")


# how every command that takes a checkpoint describes its argument
CHECKPOINT_ARG_HELP = ("a run directory (its latest checkpoint), its checkpoints/latest file, a step_<N> "
                       "checkpoint folder, or its model.h5")


def step_dir_name(step):
    return f"step_{step:08d}"


def checkpoints_dir(run_dir):
    return os.path.join(run_dir, "checkpoints")


class Checksum:
    """The checksum COMPLETE records of each file: XXH3-64 (the `xxhash` package; `hexdigest()` as 16 hex
    digits), fed with `update(bytes)`. It is there to catch a truncated, altered or swapped file, not an
    adversary, and it costs next to nothing: about 18 GB/s here against SHA-256's 1.6 (the writer of an
    asynchronous save runs it beside training; it releases the GIL). Checkpoints of earlier versions
    record SHA-256, which `verify` still checks."""
    name = "xxh3_64"

    def __init__(self, data=None):
        import xxhash

        self._h = xxhash.xxh3_64()
        if data is not None:
            self.update(data)

    def update(self, data):
        self._h.update(data)

    def hexdigest(self):
        return self._h.hexdigest()


# what COMPLETE may record for a file: {key: (hash constructor, name in messages)}
CHECKSUMS = {Checksum.name: (Checksum, "XXH3-64"), "sha256": (hashlib.sha256, "SHA-256")}


def _file_digest(path, algorithm=Checksum):
    """`algorithm`'s hexdigest of a file's bytes (Checksum, or hashlib.sha256 for an older checkpoint)."""
    h = algorithm()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_file(path):
    with open(path, "rb") as f:
        os.fsync(f.fileno())


# HDF5 metadata beside the raw tensor bytes: object headers, group links, attributes (measured on
# the tiny config: about 1 KiB per dataset). The allowance is generous so that the check before
# writing never lets HDF5 run into a full disk: the library does not survive that cleanly (it
# can crash while closing the file).
H5_BYTES_PER_DATASET = 4 << 10
H5_BYTES_PER_FILE = 64 << 10


def _os_error_of(exc):
    """The OSError behind a failed write, also when h5py reports it as a RuntimeError naming the errno."""
    if isinstance(exc, OSError):
        return exc
    if isinstance(exc, RuntimeError):
        match = re.search(r"errno = (\d+)", str(exc))
        if match:
            code = int(match.group(1))
            return OSError(code, os.strerror(code))
    return None


# ------------------------------------------------------------------ what each rank writes
def write_range(n_local, dp, dp_rank):
    """The part [lo, hi) of a (tp, pp) rank's flat buffer that data-parallel rank `dp_rank` writes: the
    same near-equal split as ZeRO-1's optimizer slices, so every rank writes what its optimizer owns
    and the dp replicas of one shard share the writing."""
    return split_range(n_local, dp, dp_rank)


def rank_pieces(cfg, tp_rank, pp_stage, dp_rank):
    """(lo, hi, [Piece]): what rank (tp_rank, pp_stage, dp_rank) of `cfg`'s layout writes. Tensors
    replicated over tp are written by tp rank 0 only; every element of every global tensor is written
    by exactly one rank."""
    blocks = flat_blocks(param_specs(cfg, tp_rank, pp_stage))
    n = blocks[-1][2] if blocks else 0
    lo, hi = write_range(n, cfg.parallel.dp, dp_rank)
    pieces = []
    for members, a, b in blocks:
        if members[0].tp_replicated and tp_rank != 0:  # replicated tensors are blocks of their own
            continue
        pieces += block_pieces(members, a, b, lo, hi)
    return lo, hi, pieces


def rank_file_name(tp_rank, pp_stage, dp_rank):
    return f"rank-tp{tp_rank}-pp{pp_stage}-dp{dp_rank}.h5"


class RankState(NamedTuple):
    """What one rank hands to `save`: its grid coordinates (tp, pp, dp), and host arrays over its write
    range [base, base + len): the parameters and the two AdamW moments of those flat elements."""
    coords: tuple
    base: int
    params: np.ndarray
    m: np.ndarray
    v: np.ndarray

    @property
    def nbytes(self):
        return int(self.params.nbytes + self.m.nbytes + self.v.nbytes)


def rank_state(engine, optimizer):
    """This rank's RankState: views of its write range (host copies of a GPU's); an asynchronous save
    takes its own snapshot of them (PendingSave.snapshot)."""
    from boostmpi.backend import to_numpy

    c = engine.grid.coords
    lo, hi = write_range(engine.params.size, engine.grid.dp_size, c.dp)
    o_lo = optimizer.shard[0]  # the optimizer's slice always covers the write range

    return RankState((c.tp, c.pp, c.dp), lo, to_numpy(engine.master_range(lo, hi)),
                     to_numpy(optimizer.m[lo - o_lo:hi - o_lo]), to_numpy(optimizer.v[lo - o_lo:hi - o_lo]))


def global_rank_states(cfg, tensors, moments):
    """The RankState of every rank of `cfg`'s layout, cut from global tensors (name -> array) and moments
    ({name: m}, {name: v}): for writing a checkpoint of any layout from one process."""
    out = []
    for t in range(cfg.parallel.tp):
        for st in range(cfg.parallel.pp):
            specs = param_specs(cfg, t, st)
            flats = []
            for source in (tensors, *moments):
                buffer = FlatBuffer(specs, np.asarray(source[specs[0].name]).dtype)  # the engine's layout
                read_params(source, specs, buffer)
                flats.append(buffer.data)
            for d in range(cfg.parallel.dp):
                lo, hi = write_range(flats[0].size, cfg.parallel.dp, d)
                out.append(RankState((t, st, d), lo, *(f[lo:hi] for f in flats)))
    return out


# The saves of a run write files of the same structure: HDF5 is asked for it once per layout, the
# bytes it wrote are kept, and every later save writes those bytes and the tensor data by plain
# positioned writes (the GIL is released while they copy: a background save barely holds it).
_STRUCTURES = {}  # per process, the least recently used dropped first
_STRUCTURES_KEPT = 64  # enough for one process writing every rank file of a layout (save_global)


def _remember(key, value):
    if len(_STRUCTURES) >= _STRUCTURES_KEPT:
        _STRUCTURES.pop(next(iter(_STRUCTURES)))
    _STRUCTURES[key] = value
    return value


def _recall(key):
    """The kept value of `key` (marked as the most recently used), or None."""
    value = _STRUCTURES.pop(key, None)
    if value is not None:
        _STRUCTURES[key] = value
    return value


def _layout_key(kind, cfg, *extra):
    return (kind, json.dumps(cfg.to_dict(), sort_keys=True), *extra)


class RankFileLayout(NamedTuple):
    """Where everything sits in a rank file: `size` bytes; `structure`, the HDF5 bytes around the tensor
    data (superblock, object headers, attributes, links) as (offset, bytes) runs; `data`, the place of
    every dataset's elements as (offset, group, Piece), contiguous and in the flat group's dtype."""
    size: int
    structure: list
    data: list


def rank_file_layout(path, cfg, coords, dtypes):
    """The RankFileLayout of rank `coords`'s file, its arrays of `dtypes` ({group: dtype}); the first time
    for this layout, HDF5 writes the structure at `path` (space for the data reserved, not filled) and
    it is read back from there."""
    import h5py

    key = _layout_key("rank file", cfg, tuple(coords), tuple((g, np.dtype(d).str) for g, d in sorted(dtypes.items())))
    kept = _recall(key)
    if kept is not None:
        return kept
    pieces = rank_pieces(cfg, *coords)[2]
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)  # contiguous, placed now, never filled by HDF5
    dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
    dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
    data = []
    with h5py.File(path, "w") as f:
        f.attrs["format"] = FORMAT
        f.attrs["coords"] = np.asarray(coords, dtype=np.int64)
        for group in ("model", "m", "v"):
            for p in pieces:
                ds = f.create_dataset(f"{group}/{p.key}", shape=p.shape, dtype=dtypes[group], dcpl=dcpl)
                ds.attrs["box"] = np.asarray(p.box, dtype=np.int64)
                data.append((ds.id.get_offset(), group, p))
    data.sort(key=lambda item: item[0])
    size, structure, at = os.path.getsize(path), [], 0
    with open(path, "rb") as f:
        for offset, group, p in data + [(size, None, None)]:
            if offset > at:
                f.seek(at)
                structure.append((at, f.read(offset - at)))
            if p is not None:
                at = offset + p.size * np.dtype(dtypes[group]).itemsize
    return _remember(key, RankFileLayout(size, structure, data))


def _rank_file_parts(path, cfg, state):
    """(first flat element, {group: flat array}, RankFileLayout) of `state`'s rank file."""
    lo, hi, _ = rank_pieces(cfg, *state.coords)
    if (lo, hi) != (state.base, state.base + state.params.size):
        raise ValueError(f"rank {state.coords} hands over elements [{state.base}, {state.base + state.params.size}) "
                         f"but writes [{lo}, {hi})")
    flats = {"model": state.params, "m": state.m, "v": state.v}
    return lo, flats, rank_file_layout(path, cfg, state.coords, {g: a.dtype for g, a in flats.items()})


class _SpareImages:
    """Page-aligned buffers of written snapshots, kept for the next save of the same size: new memory
    costs a page fault per page on first touch (on some virtual machines as much as copying it)."""
    KEPT = 2

    def __init__(self):
        import threading

        self.lock, self.buffers = threading.Lock(), []

    def take(self, nbytes):
        import mmap

        with self.lock:
            for i, image in enumerate(self.buffers):
                if len(image) == nbytes:
                    return self.buffers.pop(i)
        return mmap.mmap(-1, nbytes)

    def give_back(self, image):
        with self.lock:
            self.buffers.append(image)
            while len(self.buffers) > self.KEPT:
                self.buffers.pop(0).close()


SPARE_IMAGES = _SpareImages()


def rank_file_image(path, cfg, state):
    """(image, size): the `size` bytes write_rank_file would write at `path`, in page-aligned memory of
    whole pages (an anonymous mmap; hand it to SPARE_IMAGES.give_back once written): the snapshot of
    an asynchronous save, written with direct I/O."""
    import mmap

    lo, flats, layout = _rank_file_parts(path, cfg, state)
    image = SPARE_IMAGES.take(max(1, -(-layout.size // mmap.PAGESIZE)) * mmap.PAGESIZE)
    raw = np.frombuffer(image, np.uint8)
    for offset, blob in layout.structure:
        raw[offset:offset + len(blob)] = np.frombuffer(blob, np.uint8)
    for offset, group, p in layout.data:
        source = flats[group]
        np.frombuffer(image, source.dtype, p.size, offset).reshape(p.shape)[...] = p.take(source, lo)
    del raw
    return image, layout.size


def write_file_image(path, image, size):
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

    def __init__(self, path, digest=None):
        import mmap

        self.path, self.digest, self.page = path, digest, mmap.PAGESIZE
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        self.direct, self.fd = hasattr(os, "O_DIRECT"), None
        if self.direct:
            try:
                self.fd = os.open(path, flags | os.O_DIRECT, 0o666)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self.direct = False
        if self.fd is None:
            self.fd = os.open(path, flags, 0o666)
        self.buffer = SPARE_IMAGES.take(self.STAGING)
        self.staged = np.frombuffer(self.buffer, np.uint8)
        self.fill, self.position = 0, 0

    def write(self, data):
        """Append `data` (bytes, or a C-contiguous NumPy array)."""
        src = np.frombuffer(data, np.uint8) if isinstance(data, bytes) else data.reshape(-1).view(np.uint8)
        while src.size:
            n = min(src.size, self.STAGING - self.fill)
            self.staged[self.fill:self.fill + n] = src[:n]
            self.fill, src = self.fill + n, src[n:]
            if self.fill == self.STAGING:
                self._flush()

    def _flush(self):
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

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        try:
            if kind is None:
                self._flush()
                # the padding of a direct write past the end (also one a file-size limit cut short
                # before the fallback rewrote its chunk) is cut off
                os.ftruncate(self.fd, self.position)
        finally:
            os.close(self.fd)
            self.staged = None
            SPARE_IMAGES.give_back(self.buffer)
        return False


def write_rank_file(path, cfg, state, digest=None):
    """One rank's file: `model/<name>/<i>`, `m/<name>/<i>`, `v/<name>/<i>` for each of its pieces,
    each dataset carrying its global box (attribute `box`); file attributes `format`, `coords`.
    `digest` (a Checksum) is fed the file's bytes in order as they are written."""
    lo, flats, layout = _rank_file_parts(path, cfg, state)
    runs = sorted([(offset, blob) for offset, blob in layout.structure]
                  + [(offset, (group, p)) for offset, group, p in layout.data], key=lambda run: run[0])
    with SequentialWriter(path, digest) as out:
        for offset, what in runs:  # they cover the file, in order
            if offset != out.position + out.fill:
                raise RuntimeError(f"{path}: the rank file's layout has a gap or an overlap at byte {offset}")
            if not isinstance(what, bytes):
                group, p = what
                what = np.ascontiguousarray(p.take(flats[group], lo))
            out.write(what)


def write_virtual_files(folder, cfg, step, adam_t, dtype):
    """model.h5 and optim.h5: every global tensor as an HDF5 virtual dataset over the rank files, by
    relative file names (the folder can be moved or copied); the fill value NaN marks an element no
    source covers, which a complete checkpoint never has. Built by HDF5 once per layout; a later save
    writes the same bytes and sets its own `step` (and `t`)."""
    import h5py

    key = _layout_key("virtual files", cfg, np.dtype(dtype).str)
    kept = _recall(key)
    if kept is not None:
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
    layouts = {}
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
    images = {}
    for file_name, _, _ in files:
        with open(os.path.join(folder, file_name), "rb") as f:
            images[file_name] = f.read()
    _remember(key, images)


def _file_record(path, phases=None, digest=None):
    """Size and checksum of a written file, once it is fsynced; `phases` (a dict) adds the seconds of each.
    `digest`: the file's Checksum, already fed its bytes as they were written (nothing is read back).

    The hash runs in a thread while the fsync waits for the disk: the file's bytes are final before
    either starts (read back from the page cache), hashing is CPU work and both release the GIL, so
    the two overlap instead of adding up."""
    import threading

    if digest is not None:
        with _PhaseTimer(phases)("fsync"):
            _fsync_file(path)
        return {"bytes": os.path.getsize(path), Checksum.name: digest.hexdigest()}
    timer, digest = _PhaseTimer(phases), {}

    def hash_it():
        try:
            with timer("checksum"):
                digest["value"] = _file_digest(path)
        except BaseException as exc:  # noqa: BLE001 - raised below, in the caller's thread
            digest["error"] = exc

    hasher = threading.Thread(target=hash_it, name="checkpoint-checksum")
    hasher.start()
    try:
        with timer("fsync"):
            _fsync_file(path)
    finally:
        hasher.join()
    if "error" in digest:
        raise digest["error"]
    return {"bytes": os.path.getsize(path), Checksum.name: digest["value"]}


def _lowest_cpu_priority():
    """Give the calling thread the lowest CPU priority (nice 19). Linux keeps a nice value per thread;
    elsewhere setpriority would change the whole process, so nothing is done there."""
    import sys
    import threading

    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


class _PhaseTimer:
    """`with timer(name):` adds the block's wall seconds to `phases[name]` (nothing when phases is None)."""

    def __init__(self, phases):
        self.phases = phases

    @contextlib.contextmanager
    def __call__(self, name):
        t = time.perf_counter()
        try:
            yield
        finally:
            if self.phases is not None:
                self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - t


def estimate_bytes(cfg, itemsize):
    """Upper estimates (whole checkpoint, largest file) of the bytes a checkpoint of `cfg`'s layout needs:
    every rank file (parameters and two moments of its pieces, HDF5 metadata per dataset), the virtual
    files and state.json."""
    par = cfg.parallel
    total, largest = H5_BYTES_PER_FILE * 3, 0
    for t in range(par.tp):
        for st in range(par.pp):
            for d in range(par.dp):
                lo, hi, pieces = rank_pieces(cfg, t, st, d)
                size = 3 * sum(p.size for p in pieces) * itemsize + 3 * H5_BYTES_PER_DATASET * len(pieces)
                size += H5_BYTES_PER_FILE
                total, largest = total + size + 6 * H5_BYTES_PER_DATASET * len(pieces), max(largest, size)
    return total, largest


class _Agreement:
    """Collective verdicts of a save over `comm` (None: one process). `check(error)` raises the first
    error any rank met, on every rank, as the same one-line UserError."""

    def __init__(self, comm):
        from boostmpi.parallel.comm import HostCollectives

        self.comm = comm
        # watched (parallel.watchdog_s): a peer that dies or stops during a save ends the job, never hangs it
        self.host = HostCollectives(comm, axis="checkpoint")

    def bcast(self, value):
        return self.host.bcast(value)

    def gather(self, value):
        return self.host.gather(value)

    def check(self, error):
        errors = self.host.allgather(error)
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise _raised(first)


def _failure(exc, name, root, needed, kept):
    """(class name, one-line message) of an exception met while writing checkpoint `name`."""
    os_exc = _os_error_of(exc)
    if os_exc is None:
        return ("CheckpointError", f"cannot write checkpoint {name}: {type(exc).__name__}: {exc}; {kept}")
    error = fs_error(os_exc, f"cannot write checkpoint {name} into", root, needed=needed)
    return ("FilesystemError", f"{error}; the partial checkpoint is removed, {kept}")


class PendingSave:
    """One checkpoint on its way, in three phases: the constructor (collective: rank 0 checks the free
    space and makes the temporary folder), `write()` (this rank's files only, no communication: it can
    run in a background thread while training goes on, from a snapshot) and `finish()` (collective: rank
    0 publishes the checkpoint once every rank reported its file complete, or everyone raises the first
    failure). `save` runs the three in a row."""

    KEPT = "the previous checkpoint and `latest` are unchanged"
    NONE_KEPT = ("there is no earlier checkpoint, so this run has nothing to resume from: make room (or raise the "
                 "limit) and start it again in a new train.run_dir, or after removing this one")

    def __init__(self, run_dir, step, cfg, states, adam_t, state, comm=None, keep=0, crash_hook=None, log=None,
                 prune_in_background=False):
        self.run_dir, self.step, self.cfg, self.states, self.adam_t, self.state = run_dir, step, cfg, states, adam_t, state
        self.comm, self.keep, self.crash_hook, self.log = comm, keep, crash_hook, log
        self.prune_in_background = prune_in_background
        self.dtype = states[0].params.dtype  # of the global tensors
        self.agree = _Agreement(comm)
        self.is_root = comm is None or comm.Get_rank() == 0
        self.root = checkpoints_dir(run_dir)
        self.name = step_dir_name(step)
        self.final = os.path.join(self.root, self.name)
        self.needed, largest = estimate_bytes(cfg, states[0].params.itemsize)
        self.records, self.error, self.written = {}, None, False
        self.images = None  # [(coords, page-aligned image, size)] once `snapshot` took them
        # this rank's wall seconds per phase: "write", "fsync", "checksum" of its rank file (and "snapshot"
        # of an asynchronous save); on rank 0 also "virtual files" (model.h5, optim.h5, state.json, their
        # fsync and checksum) and "publish"
        # (COMPLETE, rename, `latest`, pruning), and "wait" (finish's gather until every rank reported)
        self.phases = {}
        self._timer = _PhaseTimer(self.phases)
        tmp, error, self.kept = None, None, self.KEPT
        if self.is_root:
            wait_for_pruning()  # the space an earlier save's pruning frees counts
            if find_latest(run_dir) is None:  # the first save: never claim a previous checkpoint
                self.kept = self.NONE_KEPT
            try:
                make_dirs(self.root, "checkpoint folder")
                try:
                    check_space(self.root, self.needed, f"cannot write checkpoint {self.name} into", largest_file=largest)
                except FilesystemError as exc:
                    raise FilesystemError(f"{exc}; nothing was written, {self.kept}") from None
                tmp = os.path.join(self.root, f".{self.name}.tmp-{os.getpid()}")
                shutil.rmtree(tmp, ignore_errors=True)
                os.makedirs(tmp)
            except UserError as exc:
                error = (type(exc).__name__, str(exc))
        self.tmp, error, self.kept = self.agree.bcast((tmp, error, self.kept))
        self.agree.check(error)

    @property
    def nbytes(self):
        """Bytes of what this save writes from: its snapshot's memory once `snapshot` took one, else the
        arrays it was handed."""
        if self.images is not None:
            return sum(len(image) for _, image, _ in self.images)
        return sum(st.nbytes for st in self.states)

    def snapshot(self):
        """Copy what this rank writes into the bytes of its files (page-aligned, for direct I/O): from here
        on training may change the arrays the save was handed. A failure is kept for `finish`."""
        try:
            self.images = []
            for st in self.states:
                path = os.path.join(self.tmp, rank_file_name(*st.coords))
                with self._timer("snapshot"):
                    self.images.append((st.coords, *rank_file_image(path, self.cfg, st)))
        except Exception as exc:  # noqa: BLE001 -- reported on every rank by finish()
            self.error = _failure(exc, self.name, self.root, self.needed, self.kept)
            self.images = []
        self.states = None  # training owns those arrays again

    def write(self):
        """This rank's files: written (their checksum taken from the bytes as they go out), fsynced, size
        and checksum recorded; a failure is kept for `finish`."""
        if self.images is not None:
            return self._write_images()
        try:
            for st in self.states:
                path = os.path.join(self.tmp, rank_file_name(*st.coords))
                digest = Checksum()
                with self._timer("write"):
                    write_rank_file(path, self.cfg, st, digest=digest)
                self.records[os.path.basename(path)] = _file_record(path, self.phases, digest)
            if self.crash_hook:
                self.crash_hook("rank file")
        except Exception as exc:  # noqa: BLE001 -- reported on every rank by finish()
            self.error = _failure(exc, self.name, self.root, self.needed, self.kept)
        self.written = True

    def _write_images(self):
        """`write` from the snapshot: each image written with direct I/O, hashed from memory, fsynced."""
        try:
            if self.error is None:
                for coords, image, size in self.images:
                    path = os.path.join(self.tmp, rank_file_name(*coords))
                    with self._timer("write"):
                        write_file_image(path, image, size)
                    with self._timer("checksum"):
                        digest = Checksum(memoryview(image)[:size])
                    self.records[os.path.basename(path)] = _file_record(path, self.phases, digest)
                if self.crash_hook:
                    self.crash_hook("rank file")
        except Exception as exc:  # noqa: BLE001 -- reported on every rank by finish()
            self.error = _failure(exc, self.name, self.root, self.needed, self.kept)
        for _, image, _ in self.images:  # the snapshot's memory, for the next save
            SPARE_IMAGES.give_back(image)
        self.images = []
        self.written = True

    def write_in_background(self):
        """`write` for a thread of its own, at the lowest CPU priority: where training keeps every core
        busy (CPU runs) the writer takes what the training threads leave and the steps keep their pace,
        the save taking longer; on a host with idle cores (a GPU node) it runs at full speed. Its heavy
        parts (writes, checksum, fsync) release the GIL, and the checksum is taken from memory (no reading back:
        every CPU second here is one the training may miss). Call `snapshot` first."""
        _lowest_cpu_priority()
        self.write()

    def finish(self):
        """Publish the checkpoint (collective); returns its folder, or raises on every rank."""
        with self._timer("wait"):
            gathered = self.agree.gather((self.records, self.error))
        verdict = None
        if self.is_root:
            try:
                self._publish_on_root(gathered)
            except BaseException as exc:
                shutil.rmtree(self.tmp, ignore_errors=True)
                failure = _failure(exc, self.name, self.root, self.needed, self.kept)
                if isinstance(exc, UserError):
                    verdict = (type(exc).__name__, str(exc))
                elif isinstance(exc, Exception) and (self.comm is not None or _os_error_of(exc) is not None):
                    verdict = failure
                else:  # an interrupt (or, on one process, a crash a test simulates) goes up as it is
                    if self.comm is not None:
                        self.agree.bcast(failure)  # the others stop too
                    raise
        self.agree.check(self.agree.bcast(verdict))
        return self.final

    def _publish_on_root(self, gathered):
        cfg, tmp, name = self.cfg, self.tmp, self.name
        errors = [e for _, e in gathered if e is not None]
        if errors:
            raise _raised(errors[0])
        marker = {}
        for r, _ in gathered:
            marker.update(r)
        expected = {rank_file_name(t, st, d) for t in range(cfg.parallel.tp) for st in range(cfg.parallel.pp)
                    for d in range(cfg.parallel.dp)}
        if set(marker) != expected:
            raise CheckpointError(f"cannot write checkpoint {name}: rank files {sorted(expected - set(marker))} "
                                  f"were not reported; {self.kept}")
        for file_name, record in marker.items():  # every rank's file is there, as its writer recorded it
            if os.path.getsize(os.path.join(tmp, file_name)) != record["bytes"]:
                raise CheckpointError(f"cannot write checkpoint {name}: {file_name} is not the size its rank "
                                      f"wrote; {self.kept}")
        with self._timer("virtual files"):
            write_virtual_files(tmp, cfg, self.step, self.adam_t, self.dtype)
            if self.crash_hook:
                self.crash_hook("model.h5")
            with atomic_file(os.path.join(tmp, "state.json")) as f:
                json.dump(dict(self.state, step=int(self.step)), f, indent=1, sort_keys=True)
            for file_name in FILES:
                marker[file_name] = _file_record(os.path.join(tmp, file_name))
        if self.crash_hook:
            self.crash_hook("marker")
        with self._timer("publish"):
            with atomic_file(os.path.join(tmp, MARKER)) as f:
                json.dump(marker, f, indent=1, sort_keys=True)
            _publish(self.run_dir, tmp, self.final, self.step, self.keep, self.log, self.prune_in_background)


def save(run_dir, step, cfg, states, adam_t, state, comm=None, keep=0, crash_hook=None, log=None,
         prune_in_background=False):
    """Write checkpoint `step`, collectively over `comm` (every rank calls it; None: one process, which
    writes every RankState in `states`). Returns the folder on every rank.

    Every rank writes its own file `rank-tp<t>-pp<s>-dp<d>.h5` into a hidden temporary folder, at the
    same time as the others, fsyncs it and records its size and checksum. Rank 0 then writes model.h5 and
    optim.h5 (virtual datasets over the rank files) and state.json, and only when every rank reported a
    complete file writes COMPLETE (every file's size and checksum), renames the folder into place and
    replaces `latest`. A failure on any rank (a full disk, an exception) removes the temporary folder and
    raises the same one-line error on every rank; the previous checkpoint and `latest` are untouched.
    A complete folder of the same step belongs to another timeline and is moved aside, never reused.
    `crash_hook(stage)` lets tests fail at "rank file", "model.h5" or "marker"; `log(line)` receives what
    the save did besides writing. `keep > 0` removes the oldest complete checkpoints beyond `keep`, once
    the new one is published (`prune_in_background`: renamed aside at once, deleted by a thread of rank 0
    that the next save or `wait_for_pruning` joins).
    """
    pending = PendingSave(run_dir, step, cfg, states, adam_t, state, comm, keep, crash_hook, log, prune_in_background)
    pending.write()
    return pending.finish()


def _raised(error):
    """The UserError of a (class name, message) verdict, marked as raised on every rank."""
    exc = {c.__name__: c for c in (FilesystemError, CheckpointError)}.get(error[0], CheckpointError)(error[1])
    exc.all_ranks = True
    return exc


def _publish(run_dir, tmp, final, step, keep, log, prune_in_background=False):
    """Rename a complete temporary folder into place, point `latest` at it, prune to `keep`."""
    root, name = checkpoints_dir(run_dir), os.path.basename(final)
    if is_complete(final):  # another timeline's checkpoint of this step: moved aside, never reused
        moved = move_aside(run_dir, [final], f"replaced by a new checkpoint of step {step}")
        if log:
            log(f"moved the earlier checkpoint {name} of another timeline to {moved}")
    elif os.path.exists(final):  # an incomplete leftover of an earlier crash: never loaded, safe to replace
        shutil.rmtree(final)
    os.rename(tmp, final)
    fsync_dir(root)
    write_latest(run_dir, name)
    if keep > 0:
        _prune(complete_checkpoints(run_dir)[:-keep], prune_in_background, log)


_pruning = []  # the thread deleting pruned checkpoints, while one runs


def wait_for_pruning():
    """Wait until the checkpoints a save pruned in the background are deleted."""
    while _pruning:
        _pruning.pop().join()


def _prune(folders, in_background, log=None):
    """Delete checkpoint folders. Each is first renamed to a hidden temporary name in one step, so no
    reader ever finds half of a complete checkpoint (a killed deleter's leftover is removed as a stale
    temporary when the next run starts); `in_background`: the deleting (unlinking gigabytes takes the
    filesystem a while) is left to a thread."""
    import threading

    wait_for_pruning()
    doomed = []
    for folder in folders:
        hidden = os.path.join(os.path.dirname(folder), f".{os.path.basename(folder)}.tmp-pruned")
        shutil.rmtree(hidden, ignore_errors=True)
        try:
            os.rename(folder, hidden)
        except OSError as exc:  # pruning is housekeeping: the new checkpoint is published either way
            if log:
                log(f"warning: could not remove the older checkpoint {folder} ({exc.strerror or exc}); it stays")
            continue
        doomed.append(hidden)
    if not doomed:
        return

    def delete():
        for hidden in doomed:
            shutil.rmtree(hidden, ignore_errors=True)

    if not in_background:
        delete()
        return
    thread = threading.Thread(target=delete, name="boostmpi-prune")  # not a daemon: the exit waits for it
    thread.start()
    _pruning.append(thread)


def save_global(run_dir, step, cfg, tensors, moments, adam_t, state, **kwargs):
    """`save` from one process, for `cfg`'s layout, of global tensors and moments ({name: m}, {name: v})."""
    return save(run_dir, step, cfg, global_rank_states(cfg, tensors, moments), adam_t, state, **kwargs)


def write_consolidated(path, ckpt_dir):
    """A single-file copy of a checkpoint's model.h5 at `path`: the same attributes, every tensor stored
    in the file itself (no virtual datasets), for sharing one file."""
    import h5py

    src, _, _ = open_model(ckpt_dir)
    try:
        with atomic_file(path, "wb") as out, h5py.File(out, "w") as f:
            for k, v in src.attrs.items():
                f.attrs[k] = v

            def copy(name, obj):
                if isinstance(obj, h5py.Dataset):
                    f.create_dataset(name, data=obj[()])

            src.visititems(copy)
    except (OSError, RuntimeError) as exc:  # h5py may report the disk's refusal without an errno of its own
        os_exc = _os_error_of(exc)
        if os_exc is None or os_exc.errno is None:
            raise
        raise fs_error(os_exc, "cannot write", path) from exc
    finally:
        src.close()


def write_latest(run_dir, name):
    """Point `<run_dir>/checkpoints/latest` at checkpoint folder `name`, atomically."""
    write_file_atomically(os.path.join(checkpoints_dir(run_dir), "latest"), name + "\n")


ABANDONED_PREFIX = "abandoned-"


def move_aside(run_dir, folders, reason, extra_files=None):
    """Move checkpoint `folders` of an abandoned timeline into a new `checkpoints/abandoned-<time>/`
    (never loaded, never deleted) with a README line saying why; returns that folder.
    `extra_files` ({name: text}) are written beside them (the abandoned metrics rows)."""
    root = checkpoints_dir(run_dir)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    dest = os.path.join(root, ABANDONED_PREFIX + stamp)
    suffix = 1
    while os.path.exists(dest):
        suffix += 1
        dest = os.path.join(root, f"{ABANDONED_PREFIX}{stamp}-{suffix}")
    os.makedirs(dest)
    for folder in folders:
        os.rename(folder, os.path.join(dest, os.path.basename(folder)))
    for file_name, text in (extra_files or {}).items():
        write_file_atomically(os.path.join(dest, file_name), text)
    write_file_atomically(os.path.join(dest, "README"), f"{reason}\n")
    fsync_dir(root)
    return dest


def is_stale_temporary(name):
    """A temporary name a writer leaves behind when it is killed: `.step_N.tmp-PID`, `.latest.tmp-...`,
    or an atomic file's `.<name>.<random>.tmp`."""
    return name.startswith(".") and (".tmp-" in name or name.endswith(".tmp"))


def stale_temporaries(run_dir):
    """Temporary files and folders left in the run directory and its checkpoints/ by a killed writer."""
    found = []
    for folder in (run_dir, checkpoints_dir(run_dir)):
        try:
            names = sorted(os.listdir(folder))
        except OSError:
            continue
        found += [os.path.join(folder, n) for n in names if is_stale_temporary(n)]
    return found


def remove_stale_temporaries(run_dir):
    """Remove what `stale_temporaries` finds (call on one rank, before anything writes); their paths."""
    removed = stale_temporaries(run_dir)
    for path in removed:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.remove(path)
    return removed


def checkpoint_step(path):
    """The step of a checkpoint folder, from its name step_<8 digits>."""
    return int(os.path.basename(os.path.normpath(path))[len("step_"):])


def is_complete(path):
    return os.path.isfile(os.path.join(path, MARKER))


def complete_checkpoints(run_dir):
    """Complete checkpoint folders of a run, oldest first."""
    root = checkpoints_dir(run_dir)
    if not os.path.isdir(root):
        return []
    names = sorted(n for n in os.listdir(root) if n.startswith("step_") and is_complete(os.path.join(root, n)))
    return [os.path.join(root, n) for n in names]


def find_latest(run_dir):
    """The newest complete checkpoint of a run (following `latest`), or None."""
    root = checkpoints_dir(run_dir)
    try:  # `latest` that is not UTF-8 reads as no valid name: the newest complete checkpoint instead
        with open(os.path.join(root, "latest"), errors="replace") as f:
            name = f.read().strip()
        path = os.path.join(root, name)
        if name.startswith("step_") and is_complete(path):
            return path
    except OSError:
        pass
    done = complete_checkpoints(run_dir)  # `latest` missing or stale: the newest complete one
    return done[-1] if done else None


def resolve(path):
    """A verified-complete checkpoint folder from what a user may name: a run directory (its newest
    checkpoint), its `checkpoints/` folder or `checkpoints/latest` file (the one `latest` names),
    a step folder, or a step folder's model.h5."""
    path = os.fspath(path)
    if os.path.isfile(path) and os.path.basename(path) == "model.h5":
        path = os.path.dirname(path) or "."
    elif os.path.isfile(path) and os.path.basename(path) == "latest":
        try:
            with open(path, errors="replace") as f:  # not UTF-8: refused below, by what it holds
                name = f.read().strip()
        except OSError as exc:
            raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from exc
        if not name.startswith("step_") or os.sep in name:
            raise CheckpointError(f"{path} does not name a checkpoint folder (it holds {name[:40]!r})")
        path = os.path.join(os.path.dirname(path), name)
    elif os.path.isfile(path):
        raise CheckpointError(f"{path} is a file but not a checkpoint: name a run directory, its checkpoints/latest, "
                              f"a step_<N> folder or its model.h5")
    if os.path.isdir(os.path.join(path, "checkpoints")):
        found = find_latest(path)
        if found is None:
            raise CheckpointError(f"{path} holds no complete checkpoint")
        return found
    if os.path.basename(os.path.normpath(path)) == "checkpoints" and os.path.isdir(path):
        found = find_latest(os.path.dirname(os.path.abspath(path)))
        if found is None:
            raise CheckpointError(f"{path} holds no complete checkpoint")
        return found
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path} does not exist")
    if not is_complete(path):
        missing = missing_rank_files(path)
        if missing:  # a copy of model.h5 alone: HDF5 would read every tensor as NaN without a word
            raise CheckpointError(f"{os.path.join(path, 'model.h5')} is not a checkpoint by itself: its tensors are views "
                                  f"of rank files that are not beside it ({', '.join(missing[:3])}"
                                  f"{' ...' if len(missing) > 3 else ''}), and HDF5 would read them as NaN; copy the "
                                  f"whole step folder, or write one self-contained file with `boostmpi export "
                                  f"CHECKPOINT --to h5 --out FILE`")
        raise CheckpointError(f"checkpoint {path} is incomplete (no {MARKER} marker): it was never finished and is not loaded")
    return path


def missing_rank_files(folder):
    """The rank files that `folder`/model.h5's virtual datasets read from but that do not exist ([] when
    there is no such model.h5, or nothing is missing)."""
    model = os.path.join(folder, "model.h5")
    if not os.path.isfile(model):
        return []
    try:
        import h5py

        sources = set()
        with h5py.File(model, "r") as f:
            def collect(_, obj):
                if isinstance(obj, h5py.Dataset) and obj.is_virtual:
                    sources.update(vs.file_name for vs in obj.virtual_sources())

            f.visititems(collect)
    except (OSError, RuntimeError, ValueError):
        return []
    return sorted(name for name in sources if name != "." and not os.path.exists(os.path.join(folder, name)))


def recorded_files(ckpt_dir):
    """The files the COMPLETE marker records (the three global files and every rank file), sorted."""
    try:
        with open(os.path.join(ckpt_dir, MARKER)) as f:
            marker = json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint marker {os.path.join(ckpt_dir, MARKER)} is unreadable: {exc}") from exc
    if not isinstance(marker, dict):
        raise CheckpointError(f"checkpoint marker {os.path.join(ckpt_dir, MARKER)} is not a table of files")
    return marker


def verify(ckpt_dir, files=None, part=(0, 1)):
    """Check sizes and checksums against the COMPLETE marker (every recorded file, or `files`): XXH3-64,
    or SHA-256 in a checkpoint of an earlier version. A truncated, altered or missing file is refused by
    name. `part = (i, n)` checks every n-th file from the i-th, so n ranks verify a checkpoint together."""
    marker = recorded_files(ckpt_dir)
    names = sorted(marker) if files is None else list(files)
    for name in names[part[0]::part[1]]:
        path = os.path.join(ckpt_dir, name)
        if name not in marker:
            continue
        if not os.path.isfile(path):
            raise CheckpointError(f"{path} is missing")
        size = os.path.getsize(path)
        if size != marker[name]["bytes"]:
            raise CheckpointError(f"{path} is truncated or altered: {size} bytes, the checkpoint recorded {marker[name]['bytes']}")
        record = marker[name]
        key = next((k for k in CHECKSUMS if k in record), None)
        if key is None:
            raise CheckpointError(f"{os.path.join(ckpt_dir, MARKER)} records no checksum of {name}")
        algorithm, label = CHECKSUMS[key]
        if _file_digest(path, algorithm) != record[key]:
            raise CheckpointError(f"{path} is corrupted: its {label} does not match the one recorded when it was written")


def verify_together(ckpt_dir, comm=None):
    """`verify` collectively over `comm`, each rank checking its share of the files; a problem found by
    any rank is raised on every rank."""
    rank, size = (0, 1) if comm is None else (comm.Get_rank(), comm.Get_size())
    error = None
    try:
        verify(ckpt_dir, part=(rank, size))
    except CheckpointError as exc:
        error = ("CheckpointError", str(exc))
    _Agreement(comm).check(error)


def open_model(ckpt_dir, check=True):
    """(h5py.File of model.h5, its step, its config dict), verified unless check=False."""
    import h5py

    path = os.path.join(ckpt_dir, "model.h5")
    if check:  # model.h5 and the rank files its virtual datasets read
        verify(ckpt_dir, files=[n for n in recorded_files(ckpt_dir) if n not in ("optim.h5", "state.json")])
    try:
        f = h5py.File(path, "r")
    except OSError as exc:
        raise CheckpointError(f"{path} is not a readable HDF5 file: {exc}") from exc
    if f.attrs.get("format") != FORMAT:
        f.close()
        raise CheckpointError(f"{path} is not a boostmpi checkpoint (format attribute {f.attrs.get('format')!r})")
    try:
        config = json.loads(f.attrs["config"])
    except (KeyError, ValueError) as exc:
        f.close()
        raise CheckpointError(f"{path} has no readable config attribute: {exc}") from exc
    return f, int(f.attrs["step"]), config


def read_state(ckpt_dir):
    with open(os.path.join(ckpt_dir, "state.json")) as f:
        return json.load(f)


# model keys newer than some checkpoints, with the value every run before them had
MODEL_KEYS_ADDED = {"attention_dropout": 0.0}


def model_mismatch(saved_model, model):
    """The first model key whose value differs, as a message, or None (a key the checkpoint predates
    matches its value from before the key existed)."""
    for k, v in model.items():
        if k not in saved_model and k in MODEL_KEYS_ADDED and v == MODEL_KEYS_ADDED[k]:
            continue
        if saved_model.get(k) != v:
            return f"model.{k} is {v!r} in the configuration but {saved_model.get(k)!r} in the checkpoint"
    return None


# ------------------------------------------------------------------ reading, under any layout
def read_params(tensors, specs, buffer, xp=np):
    """Fill this rank's shards of FlatBuffer `buffer` from global tensors: model.h5 (an h5py File, whose
    virtual datasets read only the hyperslab asked for from the rank files holding it) or a dict."""
    for s in specs:
        buffer[s.name][...] = xp.asarray(np.asarray(tensors[s.name][s.local_slice()]), dtype=buffer.data.dtype)


def read_moments(optim_h5, params, optimizer, xp=np):
    """Fill the AdamW moments of the optimizer's slice [lo, hi) of the flat buffer (laid out like the
    FlatBuffer `params`) from optim.h5, reading for each parameter only the boxes that fall in the
    slice; sets the optimizer's step count."""
    lo, hi = optimizer.shard
    host = {"m": np.empty(hi - lo, dtype=optimizer.m.dtype), "v": np.empty(hi - lo, dtype=optimizer.v.dtype)}
    for members, a, b in params.blocks:
        for p in block_pieces(members, a, b, lo, hi):
            index = tuple(slice(x, y) for x, y in p.box)
            for which, out in host.items():
                p.put(out, lo, optim_h5[f"{which}/{p.name}"][index])
    optimizer.m[...] = xp.asarray(host["m"])
    optimizer.v[...] = xp.asarray(host["v"])
    optimizer.t = int(optim_h5.attrs["t"])


def load(ckpt_dir, specs, params, optimizer=None, xp=np):
    """This rank's parameters (FlatBuffer `params`) and, with `optimizer`, its moments and step count,
    from a checkpoint written under any layout. Returns (step, state.json's content)."""
    import h5py

    f, step, _ = open_model(ckpt_dir, check=False)
    try:  # into `params` wherever it lives (a host buffer for a rank whose master weights are a slice)
        read_params(f, specs, params, np if isinstance(params.data, np.ndarray) else xp)
    finally:
        f.close()
    if optimizer is not None:
        with h5py.File(os.path.join(ckpt_dir, "optim.h5"), "r") as fo:
            read_moments(fo, params, optimizer, xp)
    return step, read_state(ckpt_dir)
