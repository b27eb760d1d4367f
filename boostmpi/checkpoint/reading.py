"""Reading a checkpoint under any layout: verified against COMPLETE first (sizes and checksums, shared
among the ranks), then each rank reads only the hyperslabs of its own shards and optimizer slice.
Nothing is pickled or executed on load. Also the single-file copy of model.h5 that `export` writes."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, BinaryIO, TypeAlias, TypedDict

import numpy as np

from boostmpi.checkpoint.format import CHECKSUMS, FORMAT, MARKER, check_format_version, file_digest, os_error_of
from boostmpi.checkpoint.layout import read_params
from boostmpi.checkpoint.saving import Agreement
from boostmpi.errors import CheckpointError
from boostmpi.files import atomic_file, fs_error
from boostmpi.model.params import block_pieces

if TYPE_CHECKING:
    import h5py
    from mpi4py import MPI

    from boostmpi.checkpoint.held import HeldCheckpoint
    from boostmpi.checkpoint.writer import FileRecord
    from boostmpi.model.params import FlatBuffer, ParamSpec
    from boostmpi.train.optim import AdamW

SavedConfig: TypeAlias = dict[str, dict[str, object]]
"""A configuration as a checkpoint recorded it (model.h5's `config`): section -> key -> value."""


class LayoutRecord(TypedDict, total=False):
    """The layout that wrote a checkpoint (state.json's `layout`; zero_stage from a later version on)."""

    tp: int
    pp: int
    dp: int
    tp_mode: str
    zero_stage: int


class CheckpointState(TypedDict, total=False):
    """state.json: what the trainer records beside the tensors (docs/CHECKPOINTS.md)."""

    step: int
    seed: int
    data: dict[str, object]  # the training data's position (the loader's state_dict)
    layout: LayoutRecord


def recorded_files(ckpt_dir: str) -> dict[str, FileRecord]:
    """The files the COMPLETE marker records (the three global files and every rank file), sorted."""
    try:
        with open(os.path.join(ckpt_dir, MARKER)) as f:
            marker = json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint marker {os.path.join(ckpt_dir, MARKER)} is unreadable: {exc}") from exc
    if not isinstance(marker, dict):
        raise CheckpointError(f"checkpoint marker {os.path.join(ckpt_dir, MARKER)} is not a table of files")
    return marker


def verify(ckpt_dir: str, files: Iterable[str] | None = None, part: tuple[int, int] = (0, 1)) -> None:
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
        check_file(ckpt_dir, name, marker[name])


def check_file(ckpt_dir: str, name: str, record: FileRecord, opened: BinaryIO | None = None) -> None:
    """One file's size and checksum against its COMPLETE record; `opened`: the file already open
    (binary), checked through that open file rather than its path."""
    path = os.path.join(ckpt_dir, name)
    size = os.fstat(opened.fileno()).st_size if opened is not None else os.path.getsize(path)
    if size != record["bytes"]:
        raise CheckpointError(f"{path} is truncated or altered: {size} bytes, the checkpoint recorded {record['bytes']}")
    key = next((k for k in CHECKSUMS if k in record), None)
    if key is None:
        raise CheckpointError(f"{os.path.join(ckpt_dir, MARKER)} records no checksum of {name}")
    algorithm, label = CHECKSUMS[key]
    if file_digest(path, algorithm, opened) != record[key]:
        raise CheckpointError(f"{path} is corrupted: its {label} does not match the one recorded when it was written")


def verify_together(ckpt_dir: str, comm: MPI.Comm | None = None) -> None:
    """`verify` collectively over `comm`, each rank checking its share of the files; a problem found by
    any rank is raised on every rank."""
    rank, size = (0, 1) if comm is None else (comm.Get_rank(), comm.Get_size())
    error = None
    try:
        verify(ckpt_dir, part=(rank, size))
    except CheckpointError as exc:
        error = ("CheckpointError", str(exc))
    Agreement(comm).check(error)


def open_model(ckpt_dir: str, check: bool = True) -> tuple[h5py.File, int, SavedConfig]:
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
        check_format_version(path, f.attrs.get("format_version"))
        config = json.loads(f.attrs["config"])
    except CheckpointError:
        f.close()
        raise
    except (KeyError, ValueError) as exc:
        f.close()
        raise CheckpointError(f"{path} has no readable config attribute: {exc}") from exc
    return f, int(f.attrs["step"]), config


def read_state(ckpt_dir: str) -> CheckpointState:
    with open(os.path.join(ckpt_dir, "state.json")) as f:
        return json.load(f)


# model keys newer than some checkpoints, with the value every run before them had
MODEL_KEYS_ADDED = {"attention_dropout": 0.0}


def model_mismatch(saved_model: Mapping[str, object], model: Mapping[str, object]) -> str | None:
    """The first model key whose value differs, as a message, or None (a key the checkpoint predates
    matches its value from before the key existed)."""
    for k, v in model.items():
        if k not in saved_model and k in MODEL_KEYS_ADDED and v == MODEL_KEYS_ADDED[k]:
            continue
        if saved_model.get(k) != v:
            return f"model.{k} is {v!r} in the configuration but {saved_model.get(k)!r} in the checkpoint"
    return None


def read_moments(optim_h5: h5py.File, params: FlatBuffer, optimizer: AdamW, xp: ModuleType = np) -> None:
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


def load(ckpt_dir: str, specs: Sequence[ParamSpec], params: FlatBuffer, optimizer: AdamW | None = None,
         xp: ModuleType = np) -> tuple[int, CheckpointState]:
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


def write_consolidated(path: str, held: HeldCheckpoint) -> None:
    """A single-file copy of a held checkpoint's model.h5 (held.HeldCheckpoint) at `path`: the same
    attributes, every tensor stored in the file itself (no virtual datasets), for sharing one file."""
    import h5py

    tensors = held.tensors()
    try:
        with atomic_file(path, "wb") as out, h5py.File(out, "w") as f:
            for k, v in held.model.attrs.items():
                f.attrs[k] = v
            for name, value in tensors.items():
                f.create_dataset(name, data=value)
    except (OSError, RuntimeError) as exc:  # h5py may report the disk's refusal without an errno of its own
        os_exc = os_error_of(exc)
        if os_exc is None or os_exc.errno is None:
            raise
        raise fs_error(os_exc, "cannot write", path) from exc
