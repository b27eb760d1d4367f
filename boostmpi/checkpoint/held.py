"""A whole checkpoint read on one process (eval, export, generate, inspect), also while the run that wrote
it goes on and prunes its older checkpoints: the reader returns one complete checkpoint's values or stops
with one line, never NaN.

model.h5's tensors are HDF5 virtual datasets over the rank files, opened by HDF5 by name when they are
read: a rank file deleted, or a folder renamed away, after the checksums were verified would read as the
fill value, NaN, without a word. So a reader here
  1. pins the folder (pins.Pin), which pruning respects, for the whole read;
  2. opens every file model.h5 reads before reading anything (a missing one is refused by name);
  3. verifies each through its open file (size and checksum against COMPLETE): what is verified is what
     is read;
  4. reads each virtual dataset's pieces from the open rank files itself, at the places model.h5's own
     mapping names, and checks that they cover every element;
  5. checks the open files' sizes again afterwards. An open file stays readable whatever happens to its
     name; a filesystem that still fails the read (NFS after a delete on another node: ESTALE) gives
     one line.

`BOOSTMPI_TEST_READER_PAUSE=<stage>:<file>` is the tests' injection point: a reader reaching `stage`
("pinned", "verified" or "read") creates `<file>.reached` and waits until `<file>` exists, so a test can
prune or delete the checkpoint at exactly that moment.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, BinaryIO, Literal

import numpy as np

from boostmpi.checkpoint.format import FORMAT, check_format_version
from boostmpi.checkpoint.pins import CheckpointGone, Pin
from boostmpi.checkpoint.reading import check_file, recorded_files
from boostmpi.checkpoint.runs import resolve
from boostmpi.errors import CheckpointError

if TYPE_CHECKING:
    from typing import Self

    import h5py

    from boostmpi.checkpoint.reading import SavedConfig

READER_PAUSE = "BOOSTMPI_TEST_READER_PAUSE"
NOT_READ_BY_MODEL = ("optim.h5", "state.json")


def pause_at(stage: str) -> None:
    """The tests' injection point (module docstring); nothing unless READER_PAUSE names `stage`."""
    want, _, path = os.environ.get(READER_PAUSE, "").partition(":")
    if want != stage or not path:
        return
    with open(path + ".reached", "w"):
        pass
    while not os.path.exists(path):
        time.sleep(0.01)


class HeldCheckpoint:
    """A checkpoint folder held for reading (module docstring): pinned, every file model.h5 reads open and,
    with `check`, verified through the open file. Use as a context manager, or call `close`."""

    files: dict[str, BinaryIO]
    _h5: dict[str, h5py.File]

    def __init__(self, ckpt_dir: str, check: bool = True) -> None:
        self.dir = ckpt_dir
        self.files, self._h5 = {}, {}
        self.pin = Pin(ckpt_dir).acquire()
        try:
            pause_at("pinned")
            self.marker = recorded_files(ckpt_dir)
            for name in sorted(n for n in self.marker if n not in NOT_READ_BY_MODEL):
                path = os.path.join(ckpt_dir, name)
                try:
                    self.files[name] = open(path, "rb")
                except FileNotFoundError:
                    raise CheckpointError(f"{path} is missing") from None
                except OSError as exc:
                    raise CheckpointError(f"cannot open {path}: {exc.strerror or exc}") from exc
            if "model.h5" not in self.files:
                raise CheckpointError(f"{os.path.join(ckpt_dir, 'COMPLETE')} records no model.h5")
            if check:
                for name, f in self.files.items():
                    check_file(ckpt_dir, name, self.marker[name], f)
            pause_at("verified")
            self.model = self._open_h5("model.h5")
            try:
                kind = self.model.attrs.get("format")
                # ({} and 0 for a file refused just below: never seen)
                self.config: SavedConfig = json.loads(self.model.attrs["config"]) if kind == FORMAT else {}
                self.step = int(self.model.attrs["step"]) if kind == FORMAT else 0
            except (KeyError, ValueError, TypeError, OSError, RuntimeError) as exc:
                raise CheckpointError(f"{self.path('model.h5')} has no readable config or step attribute: {exc}") from exc
            if kind != FORMAT:
                raise CheckpointError(f"{self.path('model.h5')} is not a boostmpi checkpoint (format attribute {kind!r})")
            check_format_version(self.path("model.h5"), self.model.attrs.get("format_version"))
        except BaseException:
            self.close()
            raise

    def path(self, name: str) -> str:
        return os.path.join(self.dir, name)

    def _open_h5(self, name: str) -> h5py.File:
        import h5py

        if name not in self._h5:
            if name not in self.files:
                raise CheckpointError(f"{self.path('model.h5')} reads {name}, which {self.path('COMPLETE')} does not record")
            try:
                self._h5[name] = h5py.File(self.files[name], "r")
            except (OSError, RuntimeError, ValueError) as exc:
                raise CheckpointError(f"{self.path(name)} is not a readable HDF5 file: {exc}") from exc
        return self._h5[name]

    def datasets(self) -> dict[str, h5py.Dataset]:
        """{name: h5py.Dataset} of model.h5 (metadata only: nothing of a rank file is read)."""
        import h5py

        found: dict[str, h5py.Dataset] = {}
        self.model.visititems(lambda name, obj: found.__setitem__(name, obj) if isinstance(obj, h5py.Dataset) else None)
        return found

    def tensors(self, names: Iterable[str] | None = None) -> dict[str, np.ndarray]:
        """{name: global np.ndarray, as stored} of model.h5's datasets (every one, or `names`)."""
        datasets = self.datasets()
        out = {}
        try:
            for name in names if names is not None else sorted(datasets):
                out[name] = self._read(name, datasets[name])
        except (OSError, RuntimeError, ValueError, KeyError) as exc:
            raise CheckpointError(f"cannot read {self.dir} whole: {type(exc).__name__}: {exc} (was it removed or "
                                  f"changed while being read?)") from exc
        pause_at("read")
        for name, f in self.files.items():  # nothing was truncated or rewritten under the open files
            size = os.fstat(f.fileno()).st_size
            if size != self.marker[name]["bytes"]:
                raise CheckpointError(f"{self.path(name)} changed while being read ({size} bytes, the checkpoint "
                                      f"recorded {self.marker[name]['bytes']})")
        return out

    def _read(self, name: str, dataset: h5py.Dataset) -> np.ndarray:
        if not dataset.is_virtual:  # a checkpoint of an earlier version: the tensor is in model.h5
            return dataset[()]
        out = np.empty(dataset.shape, dtype=dataset.dtype)
        covered = 0
        for source in dataset.virtual_sources():
            start, stop = source.vspace.get_select_bounds()
            box = tuple(slice(a, b + 1) for a, b in zip(start, stop))
            piece = self._open_h5(os.path.normpath(source.file_name))[source.dset_name][()]
            out[box] = piece.reshape(out[box].shape)
            covered += piece.size
        if covered != out.size:
            raise CheckpointError(f"{self.path('model.h5')}: the rank files cover {covered} of the {out.size} "
                                  f"elements of {name}")
        return out

    def close(self) -> None:
        for h5 in self._h5.values():
            h5.close()
        for f in self.files.values():
            f.close()
        self._h5, self.files = {}, {}
        if getattr(self, "pin", None) is not None:
            self.pin.release()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> Literal[False]:
        self.close()
        return False


def hold(path: str, check: bool = True) -> HeldCheckpoint:
    """A HeldCheckpoint of what a user named (runs.resolve). A run directory (or `latest`) whose newest
    checkpoint was pruned between resolving and pinning it is resolved again."""
    directory = resolve(path)
    for _ in range(3):
        try:
            return HeldCheckpoint(directory, check)
        except CheckpointGone:
            again = resolve(path)
            if again == directory:
                raise
            directory = again
    return HeldCheckpoint(directory, check)
