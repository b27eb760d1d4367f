"""Parameter specifications, layout-independent initialisation and flat buffers.

Every parameter is described by a `ParamSpec`: its checkpoint name (docs/FORMATS.md), its global shape, and the
slice of it that this rank holds under the configured tensor-parallel mode. The rules of which
dim is split live here and nowhere else (the engine, checkpoints and `boostmpi sim` all read them).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import numpy.typing as npt

from boostmpi.arrays import Array

if TYPE_CHECKING:
    from boostmpi.config import Config

Box = tuple[tuple[int, int], ...]  # (start, stop) per dim, global coordinates


LINEARS = ("q", "k", "v", "o", "gate", "up", "down")
ATTN_IN = ("q", "k", "v")
MLP_IN = ("gate", "up")
OUT_PROJ = ("o", "down")

# ---------------------------------------------------------------- the sharding rules
# For each tensor-parallel strategy, the dim along which each kind of parameter is split over the
# tp group (None: every tp rank holds it whole). A linear is x @ W [d_in, d_out], or x @ A @ B with
# A [d_in, R], B [R, d_out]; "W_out" is the W of o and down.
SHARD_DIM = {
    # the residual stays sharded along C: A row-parallel, B column-parallel, norms and embedding along C
    "btp": {"embed": 1, "norm": 0, "A": 0, "B": 1, "final_norm": None, "lm_head": 1},
    # Megatron on each factor: A column-parallel along R, B row-parallel along R; vocabulary-parallel embedding
    "vanilla": {"embed": 0, "norm": None, "A": 1, "B": 0, "final_norm": None, "lm_head": 1},
    # Megatron, full rank: q/k/v/gate/up column-parallel, o/down row-parallel
    "megatron": {"embed": 0, "norm": None, "W": 1, "W_out": 0, "final_norm": None, "lm_head": 1},
}
# Each dim of each linear, by the model size it is made of. Splitting "n_heads" or "n_kv_heads"
# means whole heads per rank; the vocabulary may split unevenly (the first V mod p ranks one larger).
LINEAR_DIMS = {"q": ("d_model", "n_heads"), "k": ("d_model", "n_kv_heads"), "v": ("d_model", "n_kv_heads"),
               "o": ("n_heads", "d_model"), "gate": ("d_model", "d_ff"), "up": ("d_model", "d_ff"),
               "down": ("d_ff", "d_model")}
RANK_OF = {"q": "attn_rank", "k": "attn_rank", "v": "attn_rank", "o": "attn_rank",
           "gate": "mlp_rank", "up": "mlp_rank", "down": "mlp_rank"}
_SIZE_ORDER = ("d_model", "n_heads", "n_kv_heads", "d_ff", "attn_rank", "mlp_rank")


def _kinds(mode: str) -> Iterator[tuple[str, tuple[str, ...]]]:
    """(parameter kind, the model size along each of its dims) for the matrices of a layer."""
    for lin in LINEARS:
        d_in, d_out = LINEAR_DIMS[lin]
        if mode == "megatron":
            yield ("W_out" if lin in OUT_PROJ else "W"), (d_in, d_out)
        else:
            yield "A", (d_in, RANK_OF[lin])
            yield "B", (RANK_OF[lin], d_out)
    yield "embed", ("vocab_size", "d_model")
    yield "norm", ("d_model",)


def sizes_split_evenly(mode: str) -> list[str]:
    """The model sizes that tp strategy `mode` splits into equal parts (each must divide by tp), in
    config order; derived from SHARD_DIM."""
    split = {dims[dim] for kind, dims in _kinds(mode) if (dim := SHARD_DIM[mode][kind]) is not None}
    return [size for size in _SIZE_ORDER if size in split]


@dataclass(frozen=True)
class ParamSpec:
    name: str
    global_shape: tuple[int, ...]
    shard_dim: int | None  # None when every tp rank holds the whole tensor
    start: int  # local range along shard_dim (0, size when not sharded)
    stop: int
    decay: bool  # AdamW weight decay applies (matrices: yes; norm weights: no)
    init: str  # "ones" or "normal"
    init_std: float
    layer: int | None  # layer index, or None for embed / final_norm / lm_head
    group: str | None = None  # the grouped GEMM reading this factor ("layers/<i>/attn_in", ".../mlp_in"), or None

    @property
    def local_shape(self) -> tuple[int, ...]:
        if self.shard_dim is None:
            return tuple(self.global_shape)
        shape = list(self.global_shape)
        shape[self.shard_dim] = self.stop - self.start
        return tuple(shape)

    @property
    def local_numel(self) -> int:
        return int(np.prod(self.local_shape))

    @property
    def tp_replicated(self) -> bool:
        return self.shard_dim is None

    def local_slice(self) -> tuple[slice, ...]:
        index = [slice(None)] * len(self.global_shape)
        if self.shard_dim is not None:
            index[self.shard_dim] = slice(self.start, self.stop)
        return tuple(index)


def split_range(size: int, parts: int, index: int) -> tuple[int, int]:
    """Contiguous range of `index` among `parts` near-equal pieces of `size` (first ones one larger)."""
    base, extra = divmod(size, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def chunk_layers(n_layers: int, pp: int, stage: int, virtual_stages: int = 1) -> list[range]:
    """The layer chunks pipeline rank `stage` of `pp` runs, one range per chunk: with v virtual stages
    the layers are cut into pp * v contiguous near-equal chunks and rank s holds chunks s, s + pp, ..."""
    n = pp * virtual_stages
    return [range(*split_range(n_layers, n, c * pp + stage)) for c in range(virtual_stages)]


def stage_layers(n_layers: int, pp: int, stage: int, virtual_stages: int = 1) -> Sequence[int]:
    """The layers that pipeline rank `stage` of `pp` runs, in increasing order (contiguous, near-equal
    under plain 1F1B; its chunks, one after the other, when interleaved)."""
    if virtual_stages == 1:
        return range(*split_range(n_layers, pp, stage))
    return [i for chunk in chunk_layers(n_layers, pp, stage, virtual_stages) for i in chunk]


def tp_strategy(cfg: Config) -> str:
    """Which tensor-parallel scheme the engine runs: 'btp', 'vanilla' (low-rank) or 'megatron' (full rank)."""
    if not cfg.model.is_lowrank:
        return "megatron"
    return cfg.parallel.tp_mode


def param_specs(cfg: Config, tp_rank: int = 0, pp_stage: int = 0) -> list[ParamSpec]:
    """All parameters held by (tp_rank, pp_stage), in flat-buffer order.

    Order: embedding (first stage), then layer by layer, then final norm and LM head (last
    stage), so that a layer's parameters are one contiguous range (one data-parallel bucket).
    """
    m, par = cfg.model, cfg.parallel
    p, t = par.tp, tp_rank
    rule = SHARD_DIM[tp_strategy(cfg)]
    C, V, L = m.d_model, m.vocab_size, m.n_layers
    specs = []

    def add(name: str, shape: tuple[int, ...], kind: str, decay: bool, init: str, std: float, layer: int | None,
            group: str | None = None) -> None:
        dim = rule[kind] if p > 1 else None
        start, stop = split_range(shape[dim], p, t) if dim is not None else (0, 0)
        specs.append(ParamSpec(name, tuple(shape), dim, start, stop, decay, init, std, layer, group))

    first, last = pp_stage == 0, pp_stage == par.pp - 1
    if first:
        add("embed", (V, C), "embed", True, "normal", 0.02, None)
    out_scale = 1.0 / np.sqrt(2.0 * L)
    shapes = m.linear_shapes()
    for i in stage_layers(L, par.pp, pp_stage, par.virtual_stages):
        pre = f"layers/{i}"
        for norm, group in (("attn_norm", ATTN_IN), ("mlp_norm", MLP_IN)):
            add(f"{pre}/{norm}", (C,), "norm", False, "ones", 0.0, i)
            # the group's first factors side by side (one grouped GEMM reads them), then the rest
            grouped = f"{pre}/{'attn_in' if group is ATTN_IN else 'mlp_in'}"
            for lin in group:
                d_in, d_out, r = shapes[lin]
                if r is None:
                    add(f"{pre}/{lin}/W", (d_in, d_out), "W", True, "normal", 0.02, i, grouped)
                else:
                    add(f"{pre}/{lin}/A", (d_in, r), "A", True, "normal", _lowrank_std(d_in, d_out, r), i, grouped)
            for lin in group:
                d_in, d_out, r = shapes[lin]
                if r is not None:
                    add(f"{pre}/{lin}/B", (r, d_out), "B", True, "normal", _lowrank_std(d_in, d_out, r), i)
            out = OUT_PROJ[0] if group is ATTN_IN else OUT_PROJ[1]
            d_in, d_out, r = shapes[out]
            if r is None:
                add(f"{pre}/{out}/W", (d_in, d_out), "W_out", True, "normal", 0.02 * out_scale, i)
            else:
                add(f"{pre}/{out}/A", (d_in, r), "A", True, "normal", _lowrank_std(d_in, d_out, r), i)
                add(f"{pre}/{out}/B", (r, d_out), "B", True, "normal", _lowrank_std(d_in, d_out, r), i)
    if last:
        add("final_norm", (C,), "final_norm", False, "ones", 0.0, None)
        add("lm_head", (C, V), "lm_head", True, "normal", 0.02, None)
    return specs


def _lowrank_std(d_in: int, d_out: int, r: int) -> float:
    return float(r) ** -0.25 * float(d_in + d_out) ** -0.25


def all_global_specs(cfg: Config) -> list[ParamSpec]:
    """Every parameter of the model once, with its global shape (the checkpoint's tensors)."""
    seen: dict[str, ParamSpec] = {}
    for stage in range(cfg.parallel.pp):
        for s in param_specs(cfg, 0, stage):
            seen.setdefault(s.name, s)
    return list(seen.values())


def _stream_key(seed: int, name: str) -> npt.NDArray[np.uint64]:
    """The Philox key of one parameter: (seed, CRC-32 of its name)."""
    return np.array([int(seed), zlib.crc32(name.encode())], dtype=np.uint64)


def _normals(key: npt.NDArray[np.uint64], start: int, count: int) -> npt.NDArray[np.float64]:
    """Standard normals of elements [start, start + count) of a parameter's stream, in float64.

    Elements 2j and 2j+1 of the global tensor (C order) are the Box-Muller pair made from 64-bit words
    2j and 2j+1 of the Philox-4x64 stream keyed by `key` (53-bit uniforms u, v as NumPy's `random()`
    makes them: radius sqrt(-2 ln(1 - u)), angle 2 pi v; cosine then sine). So any run of elements is
    produced on its own, by advancing the counter to the run's first pair, and equals the same elements
    of the whole tensor bit for bit."""
    first, last = start // 2, (start + count + 1) // 2  # the pairs the run touches
    block, skip = divmod(2 * first, 4)  # a counter value gives four words: two pairs
    words = np.random.Generator(np.random.Philox(key=key, counter=[block, 0, 0, 0])).random(skip + 2 * (last - first))
    u, v = words[skip::2], words[skip + 1::2]
    np.subtract(1.0, u, out=u)  # (0, 1]
    np.log(u, out=u)
    u *= -2.0
    np.sqrt(u, out=u)
    v *= 2.0 * np.pi
    out = np.empty(2 * (last - first))
    np.cos(v, out=out[0::2])
    np.sin(v, out=out[1::2])
    out[0::2] *= u
    out[1::2] *= u
    return out[start - 2 * first:start - 2 * first + count]


def global_runs(spec: ParamSpec, box: Box) -> list[tuple[int, int, slice]]:
    """The rectangle `box` (a tuple of (start, stop) per dim, global coordinates) of `spec`'s tensor as
    C-order runs: [(first global element index, length, slice of the box as a flat array)]."""
    shape = spec.global_shape
    if len(shape) == 1 or box[1] == (0, shape[1]):  # whole rows (or a vector): one run
        count = int(np.prod([b - a for a, b in box]))
        return [(box[0][0] * int(np.prod(shape[1:], dtype=np.int64)), count, slice(0, count))]
    (r0, r1), (c0, c1) = box
    width = c1 - c0
    return [(row * shape[1] + c0, width, slice(i * width, (i + 1) * width)) for i, row in enumerate(range(r0, r1))]


def init_box(spec: ParamSpec, seed: int, box: Box) -> npt.NDArray[np.float64]:
    """The elements of `spec`'s initial tensor inside `box` (global coordinates), without drawing the
    rest: the same values whatever the layout that asks for them."""
    shape = tuple(b - a for a, b in box)
    if spec.init == "ones":
        return np.ones(shape, dtype=np.float64)
    out = np.empty(int(np.prod(shape)), dtype=np.float64)
    key = _stream_key(seed, spec.name)
    for start, count, where in global_runs(spec, box):
        out[where] = _normals(key, start, count)
    out *= spec.init_std
    return out.reshape(shape)


def local_box(spec: ParamSpec) -> Box:
    """This rank's shard of `spec` as a box (global coordinates)."""
    box = [(0, n) for n in spec.global_shape]
    if spec.shard_dim is not None:
        box[spec.shard_dim] = (spec.start, spec.stop)
    return tuple(box)


def init_local(spec: ParamSpec, seed: int) -> npt.NDArray[np.float64]:
    """This rank's shard of `spec`'s initial tensor (float64), drawn element by element."""
    return init_box(spec, seed, local_box(spec))


def init_global(spec: ParamSpec, seed: int) -> npt.NDArray[np.float64]:
    """The whole initial tensor of `spec` (tests and tools; the engine draws only its shards)."""
    return init_box(spec, seed, tuple((0, n) for n in spec.global_shape))


class FlatBuffer:
    """One flat array holding every local parameter (or gradient, or moment), with named views.

    Parameters lie in spec order. The factors one grouped GEMM reads (the A factors, or the full-rank
    W, of q/k/v and of gate/up: specs sharing a `group`) are stored side by side, as the column
    blocks of one [d_in_local, sum of widths] matrix: `columns(names)` is that matrix as a view, and
    each factor's view is its column slice. `spans[name]` is the flat range of the block holding a
    parameter (its own range, or its group's)."""

    def __init__(self, specs: Iterable[ParamSpec], dtype: npt.DTypeLike, xp: ModuleType = np,
                 data: Array | None = None) -> None:
        self.specs = list(specs)
        self.blocks = flat_blocks(self.specs)  # [(specs, start, stop)]
        size = self.blocks[-1][2] if self.blocks else 0
        self.data = xp.zeros(size, dtype=dtype) if data is None else data
        self.views, self.spans, self._groups = {}, {}, {}
        for members, a, b in self.blocks:
            block = self.data[a:b]
            if len(members) == 1:
                self.views[members[0].name] = block.reshape(members[0].local_shape)
            else:
                rows = members[0].local_shape[0]
                block = block.reshape(rows, -1)
                self._groups[tuple(s.name for s in members)] = block
                col = 0
                for s in members:
                    self.views[s.name] = block[:, col: col + s.local_shape[1]]
                    col += s.local_shape[1]
            for s in members:
                self.spans[s.name] = (a, b)

    def __getitem__(self, name: str) -> Array:
        return self.views[name]

    def __setitem__(self, name: str, value: Array) -> None:
        # `buf[name] += g` updates the view in place, then assigns it back to itself
        view = self.views[name]
        if value is not view:
            view[...] = value

    def __contains__(self, name: object) -> bool:
        return name in self.views

    @property
    def size(self) -> int:
        return self.data.size

    def stacked(self, names: Sequence[str]) -> Array | None:
        """[P[n_1], P[n_2], ...] as one [len(names), *shape] view when they are parameters of one shape
        stored one right after another, each its own block (the B factors of k and v, of gate and
        up), else None."""
        shape = self.views[names[0]].shape
        spans = [self.spans[n] for n in names]
        size = spans[0][1] - spans[0][0]
        if any(self.views[n].shape != shape or b - a != size or self.views[n].size != size for n, (a, b) in
               zip(names, spans)) or any(b != a2 for (_, b), (a2, _) in zip(spans, spans[1:])):
            return None
        return self.data[spans[0][0]:spans[-1][1]].reshape((len(names),) + tuple(shape))

    def side_by_side(self, names: Sequence[str]) -> Array | None:
        """[P[n_1] | P[n_2] | ...] as the one view of a group stored side by side (or the one name's
        view), else None: what a product may write or accumulate into in place."""
        return self.views[names[0]] if len(names) == 1 else self._groups.get(tuple(names))

    def columns(self, names: Sequence[str]) -> Array:
        """[P[n_1] | P[n_2] | ...]: a view when these are a group stored side by side (or one
        name), else a concatenated copy."""
        if len(names) == 1:
            return self.views[names[0]]
        group = self._groups.get(tuple(names))
        if group is not None:
            return group
        from boostmpi.backend import get_array_module  # here: importing params (as sim does) needs no CuPy

        xp = get_array_module(self.data)
        return xp.concatenate([self.views[n] for n in names], axis=1)


# ------------------------------------------------------------------ global boxes of a flat range
class Piece(NamedTuple):
    """One box of a global tensor held in a range of a rank's flat buffer (what a rank writes to a
    checkpoint, or draws at initialisation): `name`, its `index` among the range's pieces of the tensor, `box` ((start, stop) per dim, global coordinates), and where its elements sit in
    the rank's flat buffer: the block (the parameter's own range, or its group's [rows, width] matrix
    of factors side by side) starting at flat offset `start`, of row `width`, rows `rows` and columns
    `cols` of it."""
    name: str
    index: int  # type: ignore[assignment]  # a field named as tuple's method, which NamedTuple allows
    box: Box
    start: int
    width: int
    rows: tuple[int, int]
    cols: tuple[int, int]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in self.box)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    @property
    def key(self) -> str:
        return f"{self.name}/{self.index}"

    def _region(self, flat: Array, base: int) -> Array:
        (r0, r1), (c0, c1) = self.rows, self.cols
        if r1 - r0 == 1:  # part of one row: contiguous
            i = self.start + r0 * self.width + c0 - base
            return flat[i:i + c1 - c0]
        i = self.start + r0 * self.width - base  # whole rows of the block: its columns c0:c1
        return flat[i:i + (r1 - r0) * self.width].reshape(r1 - r0, self.width)[:, c0:c1]

    def take(self, flat: Array, base: int) -> Array:
        """The piece's values from `flat`, a flat buffer's elements [base, base + len(flat))."""
        return self._region(flat, base).reshape(self.shape)

    def put(self, flat: Array, base: int, values: npt.ArrayLike) -> None:
        """Store the piece's values into `flat` (elements [base, ...) of a flat buffer)."""
        region = self._region(flat, base)
        region[...] = np.asarray(values).reshape(region.shape)


def _rects(rows: int, width: int, a: int, b: int) -> list[tuple[int, int, int, int]]:
    """The flat range [a, b) of a [rows, width] matrix as rectangles (r0, r1, c0, c1): a partial first
    row, whole rows, a partial last row."""
    r0, c0 = divmod(a, width)
    r1, c1 = divmod(b, width)
    if r0 == r1:
        return [(r0, r0 + 1, c0, c1)] if c1 > c0 else []
    out = []
    if c0:
        out.append((r0, r0 + 1, c0, width))
        r0 += 1
    if r1 > r0:
        out.append((r0, r1, 0, width))
    if c1:
        out.append((r1, r1 + 1, 0, c1))
    return out


def block_pieces(members: list[ParamSpec], start: int, stop: int, lo: int, hi: int) -> list[Piece]:
    """The Pieces of a flat-buffer block [start, stop) (its parameters `members`, side by side when a
    group) that fall in the flat range [lo, hi)."""
    a, b = max(start, lo), min(stop, hi)
    if a >= b:
        return []
    matrix = len(members[0].local_shape) == 2
    rows = members[0].local_shape[0] if matrix else 1
    width = (stop - start) // rows
    out, col = [], 0
    for s in members:
        w, index = (s.local_shape[1] if matrix else s.local_numel), 0
        origin = [lo_ for lo_, _ in local_box(s)]  # the shard's place in the global tensor
        for r0, r1, c0, c1 in _rects(rows, width, a - start, b - start):
            x0, x1 = max(c0, col), min(c1, col + w)
            if x0 >= x1:
                continue
            local = ((r0, r1), (x0 - col, x1 - col)) if matrix else ((x0 - col, x1 - col),)
            box = tuple((p + o, q + o) for (p, q), o in zip(local, origin))
            out.append(Piece(s.name, index, box, start, width, (r0, r1), (x0, x1)))
            index += 1
        col += w
    return out


def flat_blocks(specs: Iterable[ParamSpec]) -> list[tuple[list[ParamSpec], int, int]]:
    """The flat buffer's layout, [(specs, start, stop)]: consecutive specs of one group form one block
    (stored side by side); every other spec is a block of its own."""
    blocks: list[tuple[list[ParamSpec], int, int]] = []
    offset = 0
    for s in specs:
        if blocks and s.group is not None and blocks[-1][0][-1].group == s.group:
            members, a, _ = blocks[-1]
            blocks[-1] = (members + [s], a, offset + s.local_numel)
        else:
            blocks.append(([s], offset, offset + s.local_numel))
        offset += s.local_numel
    return blocks
