"""The checkpoint format (docs/CHECKPOINTS.md): the names on disk, the checksum COMPLETE records and the
allowance for HDF5's own bytes.

  <run_dir>/checkpoints/step_00000010/
      rank-tp<t>-pp<s>-dp<d>.h5   what each rank wrote: its pieces of the parameters and AdamW moments
      model.h5     global parameter tensors: virtual datasets over the rank files (plain h5py reads them)
      optim.h5     AdamW moments `m/<name>`, `v/<name>` as global tensors (virtual), attribute `t`
      state.json   step, data position, RNG seed, layout that wrote it
      COMPLETE     written last: sizes and XXH3-64 checksums of every file above
  <run_dir>/checkpoints/latest   the name of the newest complete checkpoint
  <run_dir>/checkpoints/abandoned-<time>/   checkpoints of a timeline a run did not continue
"""

import contextlib
import hashlib
import os
import re
from typing import BinaryIO, Callable, Protocol

from boostmpi.arrays import Array
from boostmpi.errors import CheckpointError
from boostmpi.files import StrPath

FORMAT = "boostmpi"
FORMAT_VERSION = 1  # the newest format this build writes and reads; every older one still reads
MARKER = "COMPLETE"
FILES = ("model.h5", "optim.h5", "state.json")


# how every command that takes a checkpoint describes its argument
CHECKPOINT_ARG_HELP = ("a run directory (its latest checkpoint), its checkpoints/latest file, a step_<N> "
                       "checkpoint folder, or its model.h5")


def check_format_version(path: StrPath, version: object) -> None:
    """Refuse model.h5 at `path` when its `format_version` attribute (`version`; None where the file has
    none) is newer than FORMAT_VERSION: a later boostmpi wrote it, and this build cannot know what it
    changed. An older or equal version reads as it always did."""
    if version is None:
        return
    try:
        number = int(str(version))  # an HDF5 attribute reads as a NumPy integer
    except (TypeError, ValueError):
        raise CheckpointError(f"{path} has an unreadable format_version attribute ({version!r})") from None
    if number > FORMAT_VERSION:
        raise CheckpointError(f"{path} is of checkpoint format version {number}, newer than version {FORMAT_VERSION}, "
                              f"the newest this build of boostmpi reads: read it with the boostmpi that wrote it")


def newer_format(folder: StrPath) -> CheckpointError | None:
    """The refusal of checkpoint `folder` when its model.h5 is of a newer format (check_format_version),
    checked before anything else is read from it, or None: also None when model.h5 cannot be read here,
    which the checks that follow refuse in their own words."""
    import h5py

    path = os.path.join(folder, "model.h5")
    try:
        with h5py.File(path, "r") as f:
            version = f.attrs.get("format_version")
    except (OSError, RuntimeError, ValueError):
        return None
    try:
        check_format_version(path, version)
    except CheckpointError as exc:
        return exc
    return None


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def checkpoints_dir(run_dir: StrPath) -> str:
    return os.path.join(run_dir, "checkpoints")


class Checksum:
    """The checksum COMPLETE records of each file: XXH3-64 (the `xxhash` package; `hexdigest()` as 16 hex
    digits), fed with `update(bytes)`. It is there to catch a truncated, altered or swapped file, not an
    adversary, and it costs next to nothing: about 18 GB/s here against SHA-256's 1.6 (the writer of an
    asynchronous save runs it beside training; it releases the GIL). Checkpoints of earlier versions
    record SHA-256, which `verify` still checks."""
    name = "xxh3_64"

    def __init__(self, data: Array | bytes | None = None) -> None:
        import xxhash

        self._h = xxhash.xxh3_64()
        if data is not None:
            self.update(data)

    def update(self, data: Array | bytes) -> None:
        self._h.update(data)

    def hexdigest(self) -> str:
        return str(self._h.hexdigest())


class Digest(Protocol):
    """What a checksum of COMPLETE is fed with and gives (Checksum, hashlib's SHA-256)."""

    def update(self, data: bytes, /) -> None: ...

    def hexdigest(self) -> str: ...


# what COMPLETE may record for a file: {key: (hash constructor, name in messages)}
CHECKSUMS: dict[str, tuple[Callable[[], Digest], str]] = {Checksum.name: (Checksum, "XXH3-64"), "sha256": (hashlib.sha256, "SHA-256")}


def file_digest(path: StrPath, algorithm: Callable[[], Digest] = Checksum, opened: BinaryIO | None = None) -> str:
    """`algorithm`'s hexdigest of a file's bytes (Checksum, or hashlib.sha256 for an older checkpoint);
    `opened`: the file already open (binary), read from its start."""
    h = algorithm()
    with contextlib.nullcontext(opened) if opened is not None else open(path, "rb") as f:
        f.seek(0)
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def fsync_file(path: StrPath) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


# HDF5 metadata beside the raw tensor bytes: object headers, group links, attributes (measured on
# the tiny config: about 1 KiB per dataset). The allowance is generous so that the check before
# writing never lets HDF5 run into a full disk: the library does not survive that cleanly (it
# can crash while closing the file).
H5_BYTES_PER_DATASET = 4 << 10
H5_BYTES_PER_FILE = 64 << 10


def os_error_of(exc: BaseException) -> OSError | None:
    """The OSError behind a failed write, also when h5py reports it as a RuntimeError naming the errno."""
    if isinstance(exc, OSError):
        return exc
    if isinstance(exc, RuntimeError):
        match = re.search(r"errno = (\d+)", str(exc))
        if match:
            code = int(match.group(1))
            return OSError(code, os.strerror(code))
    return None


def rank_file_name(tp_rank: int, pp_stage: int, dp_rank: int) -> str:
    return f"rank-tp{tp_rank}-pp{pp_stage}-dp{dp_rank}.h5"


def checkpoint_step(path: StrPath) -> int:
    """The step of a checkpoint folder, from its name step_<8 digits>."""
    return int(os.path.basename(os.path.normpath(path))[len("step_"):])
