"""The training engine of one rank: parameters, the pipeline schedule, recompute, data-parallel buckets.

`Engine.forward_backward(micro_batches)` runs one optimizer step's forward and backward passes
over this data-parallel rank's micro-batches and leaves the global-mean gradient in
`engine.grads` (already summed over dp). The optimizer lives in boostmpi/train.

Data parallelism (docs/COMMUNICATION.md): with `zero_stage = 0` every dp rank all-reduces the whole
gradient and updates the whole flat buffer. With `zero_stage = 1` (ZeRO stage 1) dp rank r owns
the contiguous slice `shard` of the flat buffer (`split_range(size, dp, r)`): each bucket's gradient
is reduce-scattered as soon as it is final, so rank r receives the summed gradient of its slice only
(`grad_shard`); AdamW keeps moments for that slice only and updates it; `optimizer_step` then
all-gathers the updated slices so every rank holds the whole buffer again. Under GPU mixed precision
the float32 master weights exist for the slice only (`master`): the updated slice is rounded into
the bf16 compute buffer (`params`), and that buffer is what is all-gathered.
"""

import numpy as np

from boostmpi.backend import compute_dtype, get_array_module, get_xp, keep_host_memory, param_dtype
from boostmpi.gpu.ranges import named_range
from boostmpi.model import layers
from boostmpi.model.params import (FlatBuffer, block_pieces, chunk_layers, init_box, init_local, param_specs,
                                   split_range, stage_layers)
from boostmpi.model.recompute import POLICIES, Saved, Tape
from boostmpi.model.transformer import Block, BlockCache
from boostmpi.parallel.comm import HostCollectives, configure_watchdog
from boostmpi.parallel.grid import Coords, ProcessGrid, rank_of
from boostmpi.parallel.pipeline import FORWARD, message_tag, steps_with_messages
from boostmpi.parallel.tensor_parallel import make_strategy
from boostmpi.train.optim import clip_coefficient, touched


def _nbytes(obj, seen):
    """Bytes of the distinct arrays (by their base buffer) reachable from a cache structure."""
    if obj is None or isinstance(obj, (str, int, float, bool, slice)):
        return 0
    if isinstance(obj, Tape):
        return _nbytes(obj.items, seen)
    if isinstance(obj, (Saved, BlockCache)):
        return _nbytes(vars(obj), seen)
    if isinstance(obj, dict):
        return sum(_nbytes(o, seen) for o in obj.values())
    if isinstance(obj, (tuple, list)):
        return sum(_nbytes(o, seen) for o in obj)
    if hasattr(obj, "nbytes") and hasattr(obj, "base"):
        base = obj
        while getattr(base, "base", None) is not None and hasattr(base.base, "nbytes"):
            base = base.base
        if id(base) in seen:
            return 0
        seen.add(id(base))
        return int(base.nbytes)
    return 0



def read_to_host(xp, values):
    """`values` (floats, or on a GPU 0-d float64 device arrays) as floats: the device ones copied to
    the host together, in one synchronisation."""
    on_device = [i for i, v in enumerate(values) if not isinstance(v, (float, int))]
    if not on_device:
        return [float(v) for v in values]
    got = iter(xp.stack([values[i] for i in on_device]).get().tolist())
    return [next(got) if i in on_device else float(v) for i, v in enumerate(values)]


class Engine:
    def __init__(self, cfg, world=None, local_rank=0):
        cfg.check_runnable()  # nothing only the performance model understands
        self.cfg = cfg
        m, par, tr = cfg.model, cfg.parallel, cfg.train
        self.xp = get_xp(tr.device)
        sync, use_nccl = None, False
        if self.xp is np:
            keep_host_memory()
        else:
            from boostmpi.parallel.startup import resolve_comm, select_gpu

            self.device_id = select_gpu(world, local_rank)  # and no two ranks of a node on one GPU
            # MPI reads GPU buffers directly (CUDA-aware MPI): the producing stream must be done first
            sync = lambda: self.xp.cuda.get_current_stream().synchronize()  # noqa: E731
            use_nccl = resolve_comm(par.comm, world) == "nccl"  # "auto" falls back to MPI if NCCL is missing
        configure_watchdog(par.watchdog_s)  # a collective waiting longer than this ends the job
        self.grid = ProcessGrid(world, par.tp, par.pp, par.dp, overlap=par.overlap, sync=sync, use_nccl=use_nccl,
                                ring=par.virtual_stages > 1)
        c = self.grid.coords
        self.stage, self.n_stages = c.pp, par.pp
        self.first, self.last = self.grid.is_first_stage, self.grid.is_last_stage
        self.n_chunks = par.virtual_stages  # interleaved 1F1B: this rank's layers in n_chunks chunks
        self.chunks = chunk_layers(m.n_layers, par.pp, c.pp, self.n_chunks)
        self.layers = stage_layers(m.n_layers, par.pp, c.pp, self.n_chunks)
        self.specs = param_specs(cfg, c.tp, c.pp)
        self.pdtype = param_dtype(tr.dtype)
        self.cdtype = compute_dtype(tr.dtype, self.xp)
        self.grads = FlatBuffer(self.specs, self.pdtype, self.xp)
        touched(self.grads.data)  # its pages fault in now, not in the first step's backward
        # ZeRO-1: this dp rank's slice of the flat buffer for the optimizer (the whole buffer otherwise)
        n, dp = self.grads.size, self.grid.dp_size
        self.zero_stage = par.zero_stage
        self.sharded = par.zero_stage == 1 and dp > 1
        self.dp_ranges = [split_range(n, dp, r) for r in range(dp)] if self.sharded else [(0, n)]
        self.shard = self.dp_ranges[c.dp] if self.sharded else (0, n)
        lo, hi = self.shard
        # mixed precision (bf16 on GPUs): compute on a low-precision copy; gradients accumulate in the
        # master dtype. Without ZeRO-1 the master weights are a whole flat buffer and the compute copy
        # is refreshed from it every step. With ZeRO-1 the master weights exist for this rank's slice
        # only (`master`): the optimizer updates it, casts it into the compute buffer, and the compute
        # buffer (`params`, in the compute dtype) is all-gathered.
        same = np.dtype(self.cdtype) == np.dtype(self.pdtype)
        self.master_separate = self.sharded and not same
        if self.master_separate:
            self.params = FlatBuffer(self.specs, self.cdtype, self.xp)  # compute weights, whole
            self.cparams = self.params
            self.master = touched(self.xp.empty(hi - lo, dtype=self.pdtype))  # master weights, the slice
        else:
            self.params = FlatBuffer(self.specs, self.pdtype, self.xp)  # master weights, whole
            self.cparams = self.params if same else FlatBuffer(self.specs, self.cdtype, self.xp)
            self.master = self.params.data[lo:hi]
        self.tpx = make_strategy(cfg, self.grid)
        self.rope = layers.rope_tables(m.seq_len, m.d_model // m.n_heads, m.rope_theta, self.cdtype, self.xp)
        self.policy = POLICIES[tr.recompute]()
        self.saved_activation_bytes = 0  # per micro-batch, this stage, from the last step
        self.saved_activation_bytes_per_layer = []
        self.in_flight_activation_bytes = 0  # the most held at once by the schedule, from the last step
        self._buckets = self._bucket_ranges()
        # the dp-summed gradient of the slice: its own buffer when reduce-scattered, else a view
        self.grad_shard = touched(self.xp.empty(hi - lo, dtype=self.pdtype)) if self.sharded else self.grads.data
        self._norm_ranges_cache, self._norm_bounds = None, None  # what _grad_sq sums, found once
        self.init_params(tr.seed)

    # ------------------------------------------------------------------ parameters
    def init_params(self, seed):
        """The initial weights of this rank's shards (the same global tensors under every layout). The
        data-parallel replicas of a shard share the drawing: each draws the near-equal part of the flat
        buffer that ZeRO-1 would give it, and they exchange the parts (one all-gather, not counted as
        model traffic), so building the engine takes less as dp grows. (On a GPU without ZeRO-1 the
        exchange goes through a host copy of the flat buffer.)"""
        buffer = self.master_buffer()
        xp = get_array_module(buffer.data)
        dp = self.grid.dp_size
        if dp == 1 or buffer.size >= 2**31 - 1:  # (MPI counts are ints in MPI before 4.0)
            for s in buffer.specs:
                buffer[s.name][...] = xp.asarray(init_local(s, seed))
        else:
            ranges = [split_range(buffer.size, dp, r) for r in range(dp)]
            lo, hi = ranges[self.grid.coords.dp]
            host = buffer.data if xp is np else np.empty(buffer.size, dtype=buffer.data.dtype)
            specs = {s.name: s for s in buffer.specs}
            for members, a, b in buffer.blocks:
                for p in block_pieces(members, a, b, lo, hi):
                    p.put(host, 0, init_box(specs[p.name], seed, p.box))
            HostCollectives(self.grid.dp.comm).allgather_pieces(host, [b - a for a, b in ranges])
            if host is not buffer.data:
                buffer.data[...] = xp.asarray(host)
        self.adopt_master(buffer)

    def master_buffer(self):
        """The FlatBuffer in the master dtype to write this rank's whole parameters into (init, resume):
        the parameters themselves, or, when the master weights are a ZeRO-1 slice, a transient host
        buffer that `adopt_master` then takes the slice and the compute copy from."""
        return FlatBuffer(self.specs, self.pdtype, np) if self.master_separate else self.params

    def adopt_master(self, buffer):
        if buffer is self.params:
            return
        lo, hi = self.shard
        self.master[...] = self.xp.asarray(buffer.data[lo:hi])
        self.params.data[...] = self.xp.asarray(buffer.data)  # rounded to the compute dtype

    def master_range(self, lo, hi):
        """The master weights of flat elements [lo, hi), which lie inside this rank's `shard`."""
        base = self.shard[0]
        return self.master[lo - base:hi - base]

    @property
    def param_bytes(self):
        """Bytes of weights this rank holds: the master weights (whole, or its ZeRO-1 slice) and, under
        mixed precision, the whole compute copy."""
        extra = self.cparams.data.nbytes if self.cparams.data.dtype != self.master.dtype else 0
        return int(self.master.nbytes if self.master_separate else self.params.data.nbytes) + int(extra)

    def _bucket_ranges(self):
        """Data-parallel buckets: one per layer, one for the embedding, one for the head."""
        buckets = {}
        for s in self.specs:
            key = s.layer if s.layer is not None else ("embed" if s.name == "embed" else "head")
            a, b = self.params.spans[s.name]
            lo, hi = buckets.get(key, (a, b))
            buckets[key] = (min(lo, a), max(hi, b))
        return buckets

    # ------------------------------------------------------------------ one stage, one micro-batch
    def _refresh_compute_params(self):
        if self.cparams is not self.params:
            self.cparams.data[...] = self.params.data

    def _stage_forward(self, x, y, h, keep=True, chunk=0):
        """Returns (h_out or loss, saved) of layer chunk `chunk` (the rank's only one under plain 1F1B).
        `h` is the received activation (None on the first virtual stage). With `keep`, `saved` holds
        what the recompute policy keeps for the backward."""
        P, tpx, B, T = self.cparams, self.tpx, x.shape[0], x.shape[1]
        first, last, layers = self._chunk(chunk)
        ids = self.xp.asarray(x.reshape(-1))
        if first:
            h = tpx.embed_forward(ids, P)
        saved = {"ids": ids, "layers": []}
        for i in layers:
            block = Block(i, P, tpx, self.rope, (B, T))
            with named_range(self.xp, f"layer {i} forward"):
                if not keep:
                    h, _ = block.forward(h)
                    continue
                # the first layer's input is the embedding lookup: without a collective, a policy
                # may look it up again from the token ids instead of keeping it
                input_is_lookup = first and i == layers[0] and tpx.embedding_is_local
                h, entry = self.policy.forward(block, h, input_is_lookup)
                saved["layers"].append(entry)
        if not last:
            return h, saved
        lean = keep and self.policy.lean_head
        loss, saved["head"] = tpx.head_forward(h, self.xp.asarray(y.reshape(-1)), P, lean=lean)
        return loss, saved

    def _chunk(self, chunk):
        """(holds the embedding, holds the head, layers) of this rank's layer chunk `chunk`."""
        return (self.first and chunk == 0, self.last and chunk == self.n_chunks - 1, self.chunks[chunk])

    def _stage_backward(self, dh, saved, shape, scale, on_bucket_done, chunk=0):
        P, Gr, tpx = self.cparams, self.grads, self.tpx
        first, last, layers = self._chunk(chunk)
        if last:
            dh = tpx.head_backward(saved.pop("head"), scale, P, Gr)
            on_bucket_done("head")
        # each layer's saved entry is taken out of `saved` and the block's backward empties its
        # cache: activations leave memory layer by layer as the backward goes
        look_up = lambda: tpx.embed_forward(saved["ids"], P)  # noqa: E731
        for i in reversed(layers):
            block = Block(i, P, tpx, self.rope, shape)
            entry = saved["layers"].pop()
            with named_range(self.xp, f"layer {i} backward"):
                cache = self.policy.cache(block, entry, look_up)
                del entry
                dh = block.backward(dh, cache, Gr)
            on_bucket_done(i)
        if first:
            tpx.embed_backward(saved["ids"], dh, Gr)
            on_bucket_done("embed")
        return dh

    def _account_saved(self, saved_of_chunks):
        """Bytes kept between forward and backward for one micro-batch (all of this rank's chunks):
        per layer, and in total."""
        seen, per_layer, total = set(), [], 0
        for saved in saved_of_chunks:
            layers = [_nbytes(entry, seen) for entry in saved["layers"]]
            per_layer += layers
            total += sum(layers) + _nbytes(saved, seen)
        self.saved_activation_bytes_per_layer, self.saved_activation_bytes = per_layer, total

    # ------------------------------------------------------------------ a whole step
    def forward_backward(self, micro_batches, also_sum=None):
        """Forward and backward of this dp rank's micro-batches [(x, y), ...] (int arrays [B, T]).

        Returns the mean loss over the global batch (the same value on every rank); gradients of the
        global mean loss are left in self.grads, summed over data parallelism, and their global norm
        in `grad_norm()`. Loss and norm are summed over all ranks in one host all-reduce at the end
        of the step; `also_sum()`, when given, returns more floats (counters, flags) to sum in the
        same call, read once the step's traffic is over: their sums are left in `self.summed`.
        """
        xp, grid = self.xp, self.grid
        self._refresh_compute_params()
        self.grads.data[...] = 0
        M = len(micro_batches)
        B, T = micro_batches[0][0].shape
        Cl = self.tpx.res_cols[1] - self.tpx.res_cols[0]
        scale = 1.0 / (B * T * M * grid.dp_size)
        saved, losses, sends, dp_reqs = {}, [], [], []
        held, held_peak, first_mb = {}, 0, []  # bytes in flight (saved activations), for the accounting

        def bucket_done(key, mb):
            if mb == M - 1 and grid.dp.size > 1 and key in self._buckets and grid.dp.overlap:
                dp_reqs.append(self._reduce_bucket(*self._buckets[key]))

        # messages: activations to the next virtual stage, gradients to the previous one; the
        # receive of a step is waited for right before it, its send only at the end of the step
        for step in steps_with_messages(self.n_stages, self.stage, M, self.n_chunks):
            kind, chunk, mb = step.kind, step.chunk, step.mb
            x, y = micro_batches[mb]
            got = None
            if step.recv is not None:
                got = xp.empty((B * T, Cl), dtype=self.cdtype)
                grid.pp.irecv(got, step.recv[0], tag=step.recv[1]).wait()
            if kind == "F":
                out, kept = self._stage_forward(x, y, got, chunk=chunk)
                saved[chunk, mb] = kept
                held[chunk, mb] = _nbytes(kept, set())
                held_peak = max(held_peak, sum(held.values()))
                if mb == 0:
                    first_mb.append(kept)
                    if len(first_mb) == self.n_chunks:
                        self._account_saved(first_mb)
                        first_mb = []
            else:
                del held[chunk, mb]
                out = self._stage_backward(got, saved.pop((chunk, mb)), (B, T), scale,
                                           lambda key, mb=mb: bucket_done(key, mb), chunk=chunk)
            if step.send is not None:
                out = xp.ascontiguousarray(out)
                sends.append((grid.pp.isend(out, step.send[0], tag=step.send[1]), out))
            elif kind == "F" and self.last and chunk == self.n_chunks - 1:
                losses.append(out)
        self.in_flight_activation_bytes = held_peak
        for req, _buf in sends:
            req.wait()
        if grid.dp.size > 1:
            if grid.dp.overlap:
                for r in dp_reqs:
                    r.wait()
            else:
                for a, b in self._buckets.values():
                    self._reduce_bucket(a, b, blocking=True)
        loss_sum = self._loss_sum(losses) if (self.last and grid.coords.tp == 0) else 0.0
        if self.sharded:  # the all-gather optimizer_step issues next belongs to this step's traffic
            grid.dp.count_allgather_pieces(self.params.data, [e - s for s, e in self.dp_ranges])
        # on a GPU the loss and the gradient's squared norm reach the host together: the step's one
        # synchronisation, whatever the number of micro-batches
        loss_sum, grad_sq = read_to_host(xp, [loss_sum, self._grad_sq()])
        extra = list(also_sum()) if also_sum else []
        totals = grid.host.sum([loss_sum / M, grad_sq, *extra])
        self._grad_norm = float(np.sqrt(totals[1]))
        self.summed = totals[2:]
        return float(totals[0]) / grid.dp_size

    def _loss_sum(self, losses):
        """The sum of the micro-batches' mean losses (floats, or on a GPU float64 device scalars that stay there)."""
        if not losses or all(isinstance(v, float) for v in losses):
            return float(np.sum(losses))
        return self.xp.stack(losses).sum()

    def _reduce_bucket(self, a, b, blocking=False):
        """Sum the gradient range [a, b) over dp: all-reduced in place, or (ZeRO-1) reduce-scattered into
        the owners' `grad_shard`. Returns a request to wait on (a completed one when blocking)."""
        dp, grads = self.grid.dp, self.grads.data
        if not self.sharded:
            if blocking:
                dp.allreduce(grads[a:b])
                return None
            return dp.iallreduce(grads[a:b])
        lo, hi = self.shard
        counts = [max(0, min(b, e) - max(a, s)) for s, e in self.dp_ranges]
        x0 = min(max(a, lo), hi)
        x1 = max(min(b, hi), x0)
        out = self.grad_shard[x0 - lo:x1 - lo]
        if blocking:
            dp.reduce_scatter(grads[a:b], out, counts)
            return None
        return dp.ireduce_scatter(grads[a:b], out, counts)

    def optimizer_step(self, optimizer, lr, max_norm):
        """What follows forward_backward: the exact global gradient norm, clipping to `max_norm` (0 = off),
        the AdamW update of this rank's slice and, under ZeRO-1, the all-gather of the updated slices
        over dp. Returns the norm."""
        norm = self.grad_norm()
        optimizer.step(self.grad_shard, lr, clip_coefficient(norm, max_norm))
        if self.master_separate:  # the updated slice, rounded into the compute buffer that is all-gathered
            lo, hi = self.shard
            self.params.data[lo:hi] = self.master
        if self.sharded:
            self.grid.dp.allgather_pieces(self.params.data, [e - s for s, e in self.dp_ranges], counted=True)
        return norm

    def evaluate(self, x, y):
        """Forward only, through the pipeline: the sum over all data-parallel ranks of (mean loss of
        their batch x rows). Every rank must call it; a rank with nothing to evaluate passes x = None."""
        xp, grid = self.xp, self.grid
        self._refresh_compute_params()
        mine = 0.0
        if x is not None:
            B, T = x.shape
            Cl = self.tpx.res_cols[1] - self.tpx.res_cols[0]
            S, v = self.n_stages, self.n_chunks
            for chunk in range(v):  # the activation goes round the ring of ranks once per chunk
                j = chunk * S + self.stage  # the virtual stage
                h = None
                if j > 0:
                    h = xp.empty((B * T, Cl), dtype=self.cdtype)
                    grid.pp.irecv(h, (self.stage - 1) % S, tag=message_tag(FORWARD, 0, j - 1, S, v)).wait()
                out, _ = self._stage_forward(x, y, h, keep=False, chunk=chunk)
                if j < S * v - 1:
                    grid.pp.isend(out, (self.stage + 1) % S, tag=message_tag(FORWARD, 0, j, S, v)).wait()
                elif grid.coords.tp == 0:
                    mine = read_to_host(xp, [out])[0] * B
        return float(self.grid.host.sum([mine])[0])

    # ------------------------------------------------------------------ the gradient's norm
    def _grad_sq(self):
        """This rank's part of the squared norm of the dp-summed gradient, each element counted once
        whatever the layout: tp-replicated parameters on tp rank 0 only; without ZeRO on dp rank 0 only
        (every dp rank holds the whole sum), with ZeRO-1 every dp rank over its own slice. On a GPU
        one kernel sums the squares of every block (kernels/adamw.cu, `sum_squares_ranges`) and the
        result stays on the device (forward_backward reads it with the loss)."""
        ranges = self._norm_ranges()
        g = self.grad_shard
        if self.xp is not np and ranges and g.dtype == np.float32:
            from boostmpi.gpu import kernels

            if self._norm_bounds is None:
                self._norm_bounds = self.xp.asarray(np.array(ranges, dtype=np.int64).reshape(-1))
            return kernels.sum_squares_ranges(g, self._norm_bounds)
        parts = [(g[a:b] * g[a:b]).sum() for a, b in ranges]
        if self.xp is np or not parts:
            return sum((float(p) for p in parts), 0.0)
        return self.xp.stack(parts).sum(dtype=np.float64)

    def _norm_ranges(self):
        """The ranges [a, b) of `grad_shard` whose squares `_grad_sq` sums (fixed for the engine's life)."""
        if self._norm_ranges_cache is not None:
            return self._norm_ranges_cache
        c = self.grid.coords
        lo, hi = self.shard
        ranges, seen = [], set()
        if self.sharded or c.dp == 0:
            for s in self.specs:
                if s.tp_replicated and c.tp != 0:
                    continue
                a, b = self.grads.spans[s.name]  # its block (a grouped block holds no replicated tensor)
                if a in seen:
                    continue
                seen.add(a)
                a, b = max(a, lo), min(b, hi)
                if a < b:
                    ranges.append((a - lo, b - lo))
        self._norm_ranges_cache = ranges
        return ranges

    def grad_norm(self):
        """Global L2 norm of the dp-summed gradient of the last forward_backward."""
        return self._grad_norm

    # ------------------------------------------------------------------ global tensors (tests)
    def gather_global(self, buffer):
        """The global (unsharded) tensors of a FlatBuffer laid out like the parameters.

        Every (tp, pp) rank of data-parallel replica 0 sends its flat buffer to world rank 0, which
        places each shard by its spec. Returns {name: np.ndarray} on world rank 0, None elsewhere.
        """
        from boostmpi.backend import to_numpy

        grid, cfg = self.grid, self.cfg
        c = grid.coords
        local = np.ascontiguousarray(to_numpy(buffer.data))
        if grid.world_rank != 0:
            if c.dp == 0:
                grid.host.send(local, dest=0, tag=77)
            return None
        out = {}
        for s in range(grid.pp_size):
            for t in range(grid.tp_size):
                specs = param_specs(cfg, t, s)
                src = rank_of(Coords(dp=0, pp=s, tp=t), grid.tp_size, grid.pp_size)
                if src == 0:
                    flat = local
                else:
                    flat = np.empty(sum(sp.local_numel for sp in specs), dtype=local.dtype)
                    grid.host.recv(flat, source=src, tag=77)
                remote = FlatBuffer(specs, local.dtype, np, data=flat)
                for sp in specs:
                    if sp.name not in out:
                        out[sp.name] = np.empty(sp.global_shape, dtype=local.dtype)
                    out[sp.name][sp.local_slice()] = remote[sp.name]
        return out
