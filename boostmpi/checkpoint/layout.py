"""Which rank writes which elements, and where they sit in its file: the pieces of every global tensor
that rank (tp, pp, dp) of a layout writes (each element by exactly one rank), the RankState a rank
hands to a save, the cached byte layout of a rank file, and the estimate of a checkpoint's size.
`read_params` goes the other way: a rank's shards cut out of global tensors, under any layout."""

import json
import os
from types import ModuleType
from typing import TYPE_CHECKING, Mapping, NamedTuple, Sequence, TypeVar, Union

import numpy as np
from numpy.typing import DTypeLike

from boostmpi.arrays import Array
from boostmpi.checkpoint.format import FORMAT, H5_BYTES_PER_DATASET, H5_BYTES_PER_FILE
from boostmpi.config import Config
from boostmpi.model.params import FlatBuffer, ParamSpec, Piece, block_pieces, param_specs
from boostmpi.model.params import flat_blocks  # the FlatBuffer's layout from specs alone
from boostmpi.parallel.data_parallel import zero_slices

if TYPE_CHECKING:  # for the annotations only: the engine and optimizer a save is handed
    from boostmpi.parallel.engine import Engine
    from boostmpi.train.optim import AdamW


def write_range(n_local: int, dp: int, dp_rank: int) -> tuple[int, int]:
    """The part [lo, hi) of a (tp, pp) rank's flat buffer that data-parallel rank `dp_rank` writes: its
    slice of the ZeRO split (`zero_slices`), so every rank writes what its optimizer owns under ZeRO-1
    and the dp replicas of one shard share the writing."""
    return zero_slices(n_local, dp)[dp_rank]


def rank_pieces(cfg: Config, tp_rank: int, pp_stage: int, dp_rank: int) -> tuple[int, int, list[Piece]]:
    """(lo, hi, [Piece]): what rank (tp_rank, pp_stage, dp_rank) of `cfg`'s layout writes. Tensors
    replicated over tp are written by tp rank 0 only; every element of every global tensor is written
    by exactly one rank."""
    blocks = flat_blocks(param_specs(cfg, tp_rank, pp_stage))
    n = blocks[-1][2] if blocks else 0
    lo, hi = write_range(n, cfg.parallel.dp, dp_rank)
    pieces: list[Piece] = []
    for members, a, b in blocks:
        if members[0].tp_replicated and tp_rank != 0:  # replicated tensors are blocks of their own
            continue
        pieces += block_pieces(members, a, b, lo, hi)
    return lo, hi, pieces


class RankState(NamedTuple):
    """What one rank hands to `save`: its grid coordinates (tp, pp, dp), and host arrays over its write
    range [base, base + len): the parameters and the two AdamW moments of those flat elements."""
    coords: tuple[int, int, int]
    base: int
    params: np.ndarray
    m: np.ndarray
    v: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.params.nbytes + self.m.nbytes + self.v.nbytes)


def rank_state(engine: "Engine", optimizer: "AdamW") -> RankState:
    """This rank's RankState: views of its write range (host copies of a GPU's); an asynchronous save
    takes its own snapshot of them (PendingSave.snapshot)."""
    from boostmpi.backend import to_numpy

    c = engine.grid.coords
    lo, hi = write_range(engine.params.size, engine.grid.dp_size, c.dp)
    o_lo = optimizer.shard[0]  # the optimizer's slice always covers the write range

    return RankState((c.tp, c.pp, c.dp), lo, to_numpy(engine.master_range(lo, hi)),
                     to_numpy(optimizer.m[lo - o_lo:hi - o_lo]), to_numpy(optimizer.v[lo - o_lo:hi - o_lo]))


def global_rank_states(cfg: Config, tensors: Mapping[str, Array],
                       moments: tuple[Mapping[str, Array], Mapping[str, Array]]) -> list[RankState]:
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
# what is kept: a rank file's layout, or the virtual files' bytes by file name (checkpoint/writer.py)
Kept = Union["RankFileLayout", dict[str, bytes]]
K = TypeVar("K", "RankFileLayout", dict[str, bytes])
_STRUCTURES: dict[tuple[object, ...], Kept] = {}  # per process, the least recently used dropped first
_STRUCTURES_KEPT = 64  # enough for one process writing every rank file of a layout (a test's global save)


def remember(key: tuple[object, ...], value: K) -> K:
    if len(_STRUCTURES) >= _STRUCTURES_KEPT:
        _STRUCTURES.pop(next(iter(_STRUCTURES)))
    _STRUCTURES[key] = value
    return value


def recall(key: tuple[object, ...]) -> Kept | None:
    """The kept value of `key` (marked as the most recently used), or None."""
    value = _STRUCTURES.pop(key, None)
    if value is not None:
        _STRUCTURES[key] = value
    return value


def layout_key(kind: str, cfg: Config, *extra: object) -> tuple[object, ...]:
    return (kind, json.dumps(cfg.to_dict(), sort_keys=True), *extra)


class RankFileLayout(NamedTuple):
    """Where everything sits in a rank file: `size` bytes; `structure`, the HDF5 bytes around the tensor
    data (superblock, object headers, attributes, links) as (offset, bytes) runs; `data`, the place of
    every dataset's elements as (offset, group, Piece), contiguous and in the flat group's dtype."""
    size: int
    structure: list[tuple[int, bytes]]
    data: list[tuple[int, str, Piece]]


def rank_file_layout(path: str, cfg: Config, coords: tuple[int, int, int],
                     dtypes: dict[str, DTypeLike]) -> RankFileLayout:
    """The RankFileLayout of rank `coords`'s file, its arrays of `dtypes` ({group: dtype}); the first time
    for this layout, HDF5 writes the structure at `path` (space for the data reserved, not filled) and
    it is read back from there."""
    import h5py

    key = layout_key("rank file", cfg, tuple(coords), tuple((g, np.dtype(d).str) for g, d in sorted(dtypes.items())))
    kept = recall(key)
    if isinstance(kept, RankFileLayout):
        return kept
    pieces = rank_pieces(cfg, *coords)[2]
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)  # contiguous, placed now, never filled by HDF5
    dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
    dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
    data: list[tuple[int, str, Piece]] = []
    with h5py.File(path, "w") as f:
        f.attrs["format"] = FORMAT
        f.attrs["coords"] = np.asarray(coords, dtype=np.int64)
        for group in ("model", "m", "v"):
            for p in pieces:
                ds = f.create_dataset(f"{group}/{p.key}", shape=p.shape, dtype=dtypes[group], dcpl=dcpl)
                ds.attrs["box"] = np.asarray(p.box, dtype=np.int64)
                data.append((ds.id.get_offset(), group, p))
    data.sort(key=lambda item: item[0])
    size, at = os.path.getsize(path), 0
    structure: list[tuple[int, bytes]] = []
    with open(path, "rb") as f:
        for offset, group, piece in [*data, (size, "", None)]:  # the end of the file last
            if offset > at:
                f.seek(at)
                structure.append((at, f.read(offset - at)))
            if piece is not None:
                at = offset + piece.size * np.dtype(dtypes[group]).itemsize
    return remember(key, RankFileLayout(size, structure, data))


def rank_file_parts(path: str, cfg: Config, state: RankState) -> tuple[int, dict[str, np.ndarray], RankFileLayout]:
    """(first flat element, {group: flat array}, RankFileLayout) of `state`'s rank file."""
    lo, hi, _ = rank_pieces(cfg, *state.coords)
    if (lo, hi) != (state.base, state.base + state.params.size):
        raise ValueError(f"rank {state.coords} hands over elements [{state.base}, {state.base + state.params.size}) "
                         f"but writes [{lo}, {hi})")
    flats = {"model": state.params, "m": state.m, "v": state.v}
    return lo, flats, rank_file_layout(path, cfg, state.coords, {g: a.dtype for g, a in flats.items()})


def estimate_bytes(cfg: Config, itemsize: int) -> tuple[int, int]:
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


# ------------------------------------------------------------------ global tensors to one rank's shards
def read_params(tensors: Mapping[str, Array], specs: Sequence[ParamSpec], buffer: FlatBuffer,
                xp: ModuleType = np) -> None:
    """Fill this rank's shards of FlatBuffer `buffer` from global tensors: model.h5 (an h5py File, whose
    virtual datasets read only the hyperslab asked for from the rank files holding it) or a dict."""
    for s in specs:
        buffer[s.name][...] = xp.asarray(np.asarray(tensors[s.name][s.local_slice()]), dtype=buffer.data.dtype)
