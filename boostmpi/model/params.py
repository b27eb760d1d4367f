"""Parameter specifications, layout-independent initialisation and flat buffers.

Every parameter is described by a `ParamSpec`: its CONTRACT §3 name, its global shape, and the
slice of it that this rank holds under the configured tensor-parallel mode. The rules of which
dim is split live here and nowhere else (the engine, checkpoints and `boostmpi sim` all read them).
"""

import zlib
from dataclasses import dataclass

import numpy as np

LINEARS = ("q", "k", "v", "o", "gate", "up", "down")
ATTN_IN = ("q", "k", "v")
MLP_IN = ("gate", "up")


@dataclass(frozen=True)
class ParamSpec:
    name: str
    global_shape: tuple
    shard_dim: object  # int, or None when every tp rank holds the whole tensor
    start: int  # local range along shard_dim (0, size when not sharded)
    stop: int
    decay: bool  # AdamW weight decay applies (matrices: yes; norm weights: no)
    init: str  # "ones" or "normal"
    init_std: float
    layer: object  # layer index, or None for embed / final_norm / lm_head

    @property
    def local_shape(self):
        if self.shard_dim is None:
            return tuple(self.global_shape)
        shape = list(self.global_shape)
        shape[self.shard_dim] = self.stop - self.start
        return tuple(shape)

    @property
    def local_numel(self):
        return int(np.prod(self.local_shape))

    @property
    def tp_replicated(self):
        return self.shard_dim is None

    def local_slice(self):
        index = [slice(None)] * len(self.global_shape)
        if self.shard_dim is not None:
            index[self.shard_dim] = slice(self.start, self.stop)
        return tuple(index)


def split_range(size, parts, index):
    """Contiguous range of `index` among `parts` near-equal pieces of `size` (first ones one larger)."""
    base, extra = divmod(size, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def stage_layers(n_layers, pp, stage):
    """The layers that pipeline stage `stage` of `pp` runs (contiguous, near-equal)."""
    return range(*split_range(n_layers, pp, stage))


def tp_strategy(cfg):
    """Which tensor-parallel scheme the engine runs: 'btp', 'vanilla' (low-rank) or 'megatron' (full rank)."""
    if not cfg.model.is_lowrank:
        return "megatron"
    return cfg.parallel.tp_mode


def param_specs(cfg, tp_rank=0, pp_stage=0):
    """All parameters held by (tp_rank, pp_stage), in flat-buffer order.

    Order: embedding (first stage), then layer by layer, then final norm and LM head (last
    stage), so that a layer's parameters are one contiguous range (one data-parallel bucket).
    """
    m, par = cfg.model, cfg.parallel
    p, t = par.tp, tp_rank
    mode = tp_strategy(cfg)
    C, V, L = m.d_model, m.vocab_size, m.n_layers
    specs = []

    def add(name, shape, dim, decay, init, std, layer):
        if p == 1:
            dim = None
        start, stop = split_range(shape[dim], p, t) if dim is not None else (0, 0)
        specs.append(ParamSpec(name, tuple(shape), dim, start, stop, decay, init, std, layer))

    first, last = pp_stage == 0, pp_stage == par.pp - 1
    if first:
        # btp keeps the residual sharded along C from the very start; the others split the vocabulary.
        add("embed", (V, C), 1 if mode == "btp" else 0, True, "normal", 0.02, None)
    out_scale = 1.0 / np.sqrt(2.0 * L)
    for i in stage_layers(L, par.pp, pp_stage):
        pre = f"layers/{i}"
        norm_dim = 0 if mode == "btp" else None
        add(f"{pre}/attn_norm", (C,), norm_dim, False, "ones", 0.0, i)
        for lin in LINEARS:
            if lin == "gate":
                add(f"{pre}/mlp_norm", (C,), norm_dim, False, "ones", 0.0, i)
            d_in, d_out, r = m.linear_shapes()[lin]
            if r is None:
                std = 0.02 * (out_scale if lin in ("o", "down") else 1.0)
                row_parallel = lin in ("o", "down")
                add(f"{pre}/{lin}/W", (d_in, d_out), 0 if row_parallel else 1, True, "normal", std, i)
            else:
                std = float(r) ** -0.25 * float(d_in + d_out) ** -0.25
                a_dim, b_dim = (0, 1) if mode == "btp" else (1, 0)
                add(f"{pre}/{lin}/A", (d_in, r), a_dim, True, "normal", std, i)
                add(f"{pre}/{lin}/B", (r, d_out), b_dim, True, "normal", std, i)
    if last:
        add("final_norm", (C,), None, False, "ones", 0.0, None)
        add("lm_head", (C, V), 1, True, "normal", 0.02, None)
    return specs


def all_global_specs(cfg):
    """Every parameter of the model once, with its global shape (the checkpoint's tensors)."""
    seen = {}
    for stage in range(cfg.parallel.pp):
        for s in param_specs(cfg, 0, stage):
            seen.setdefault(s.name, s)
    return list(seen.values())


def _stream_key(seed, name):
    """The Philox key of one parameter: (seed, CRC-32 of its name)."""
    return np.array([int(seed), zlib.crc32(name.encode())], dtype=np.uint64)


def _normals(key, start, count):
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


def global_runs(spec, box):
    """The rectangle `box` (a tuple of (start, stop) per dim, global coordinates) of `spec`'s tensor as
    C-order runs: [(first global element index, length, slice of the box as a flat array)]."""
    shape = spec.global_shape
    if len(shape) == 1 or box[1] == (0, shape[1]):  # whole rows (or a vector): one run
        count = int(np.prod([b - a for a, b in box]))
        return [(box[0][0] * int(np.prod(shape[1:], dtype=np.int64)), count, slice(0, count))]
    (r0, r1), (c0, c1) = box
    width = c1 - c0
    return [(row * shape[1] + c0, width, slice(i * width, (i + 1) * width)) for i, row in enumerate(range(r0, r1))]


def init_box(spec, seed, box):
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


def local_box(spec):
    """This rank's shard of `spec` as a box (global coordinates)."""
    box = [(0, n) for n in spec.global_shape]
    if spec.shard_dim is not None:
        box[spec.shard_dim] = (spec.start, spec.stop)
    return tuple(box)


def init_local(spec, seed):
    """This rank's shard of `spec`'s initial tensor (float64), drawn element by element."""
    return init_box(spec, seed, local_box(spec))


def init_global(spec, seed):
    """The whole initial tensor of `spec` (tests and tools; the engine draws only its shards)."""
    return init_box(spec, seed, tuple((0, n) for n in spec.global_shape))


class FlatBuffer:
    """One flat array holding every local parameter (or gradient, or moment), with named views."""

    def __init__(self, specs, dtype, xp=np):
        self.specs = list(specs)
        self.offsets = {}
        offset = 0
        for s in self.specs:
            self.offsets[s.name] = (offset, offset + s.local_numel)
            offset += s.local_numel
        self.data = xp.zeros(offset, dtype=dtype)
        self.views = {s.name: self.data[a:b].reshape(s.local_shape) for s, (a, b) in zip(self.specs, self.offsets.values())}

    def __getitem__(self, name):
        return self.views[name]

    def __setitem__(self, name, value):
        # `buf[name] += g` updates the view in place, then assigns it back to itself
        view = self.views[name]
        if value is not view:
            view[...] = value

    def __contains__(self, name):
        return name in self.views

    @property
    def size(self):
        return self.data.size

    def layer_ranges(self):
        """(layer or None, start, stop) contiguous groups of parameters, in buffer order."""
        groups = []
        for s in self.specs:
            a, b = self.offsets[s.name]
            if groups and groups[-1][0] == s.layer and groups[-1][2] == a:
                groups[-1] = (s.layer, groups[-1][1], b)
            else:
                groups.append((s.layer, a, b))
        return groups
