"""The training engine of one rank: forward and backward over the process grid.

`Engine.forward_backward(micro_batches)` runs one optimizer step's forward and backward passes
over this data-parallel rank's micro-batches, through the pipeline schedule and the recompute
policy, and leaves the global-mean gradient in `engine.grads` (summed over dp). What the engine
does not own: the process grid and the start-up decisions that shape it (GPU, NCCL or MPI:
parallel/startup.py `process_grid`), the gradient sum over dp and ZeRO-1 (parallel/data_parallel.py,
`engine.data_parallel`), the optimizer step (the trainer, train/trainer.py `optimizer_step`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from functools import partial
from types import ModuleType
from typing import TYPE_CHECKING, TypedDict

import numpy as np

from boostmpi.arrays import Array
from boostmpi.backend import get_array_module, get_xp, prefaulted
from boostmpi.gpu.ranges import named_range
from boostmpi.model import layers
from boostmpi.model.params import (FlatBuffer, block_pieces, chunk_layers, init_box, init_local, param_specs,
                                   stage_layers)
from boostmpi.model.recompute import POLICIES, Saved, Tape
from boostmpi.model.transformer import Block, BlockCache
from boostmpi.parallel.comm import WATCHDOG, HostCollectives
from boostmpi.parallel.data_parallel import DataParallel, zero_slices
from boostmpi.parallel.grid import ProcessGrid
from boostmpi.parallel.pipeline import FORWARD, message_tag, steps_with_messages
from boostmpi.parallel.tensor_parallel import make_strategy
from boostmpi.parallel.vocab_parallel import HeadCache
from boostmpi.precision import compute_dtype, master_dtype

if TYPE_CHECKING:
    from mpi4py import MPI

    from boostmpi.config import Config

class Stash(TypedDict, total=False):
    """What a stage's forward keeps for its backward."""
    ids: Array  # the token ids
    layers: list[Saved]  # what the recompute policy kept of each layer
    head: HeadCache  # the last stage's head

EVAL_BLOCK = 64  # batches one pipelined evaluation takes at a time (its held outputs stay bounded)


def _nbytes(obj: object, seen: set[int]) -> int:
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


def read_to_host(xp: ModuleType, values: Sequence[float | Array]) -> list[float]:
    """`values` (floats, or on a GPU 0-d float64 device arrays) as floats: the device ones copied to
    the host together, in one synchronisation. It waits for every kernel and NCCL collective queued
    before it, so it is watched like a blocking collective: a peer that never joins an NCCL call
    leaves the device waiting, and the watchdog then aborts the communicators and the job."""
    on_device = [i for i, v in enumerate(values) if not isinstance(v, (float, int))]
    if not on_device:
        return [float(v) for v in values]
    stacked = xp.stack([values[i] for i in on_device])
    got = iter(WATCHDOG.call("device", "the step's device read (every queued kernel and collective)",
                             stacked.get).tolist())
    return [next(got) if i in on_device else float(v) for i, v in enumerate(values)]


class Engine:
    """`grid`: the ProcessGrid start-up built (`startup.process_grid`); an mpi4py communicator or None
    (one process) builds it here, for tests and tools. The weights are drawn here (`init_params`)."""

    def __init__(self, cfg: Config, grid: ProcessGrid | MPI.Comm | None = None, local_rank: int = 0) -> None:
        if not isinstance(grid, ProcessGrid):
            from boostmpi.parallel.startup import process_grid

            grid = process_grid(cfg, grid, local_rank)
        self.grid: ProcessGrid
        self.cfg, self.grid = cfg, grid
        m, par, tr = cfg.model, cfg.parallel, cfg.train
        self.xp = get_xp(tr.device)
        c = self.grid.coords
        self.stage, self.n_stages = c.pp, par.pp
        self.first, self.last = self.grid.is_first_stage, self.grid.is_last_stage
        self.n_chunks = par.virtual_stages  # interleaved 1F1B: this rank's layers in n_chunks chunks
        self.chunks = chunk_layers(m.n_layers, par.pp, c.pp, self.n_chunks)
        self.layers = stage_layers(m.n_layers, par.pp, c.pp, self.n_chunks)
        self.specs = param_specs(cfg, c.tp, c.pp)
        self.pdtype = master_dtype(tr.dtype)
        self.cdtype = compute_dtype(tr.dtype, self.xp)
        self.grads = FlatBuffer(self.specs, self.pdtype, self.xp)
        prefaulted(self.grads.data)  # its pages fault in now, not in the first step's backward
        self.data_parallel = DataParallel(grid.dp, c.dp, grid.dp_size, par.zero_stage, self.specs, self.grads.spans,
                                          self.grads.size, self.xp, self.pdtype)
        self.data_parallel.attach_gradients(self.grads)
        # `shard`: the slice of the flat buffer this rank's optimizer updates (all of it without ZeRO-1);
        # `master`: its master weights; `params`: the whole buffer, `cparams` its compute-dtype copy
        self.shard = self.data_parallel.shard
        self.params, self.cparams, self.master, self.master_separate = self.data_parallel.weight_buffers(
            self.specs, self.pdtype, self.cdtype, self.xp)
        self.tp_layers = make_strategy(cfg, self.grid)  # the layers as this tp mode splits them
        self.rope = layers.rope_tables(m.seq_len, m.d_model // m.n_heads, m.rope_theta, self.cdtype, self.xp)
        self.policy = POLICIES[tr.recompute]()
        self.saved_activation_bytes = 0  # per micro-batch, this stage, from the last step
        self.saved_activation_bytes_per_layer: list[int] = []
        self.in_flight_activation_bytes = 0  # the most held at once by the schedule, from the last step
        self.init_params(tr.seed)

    # ------------------------------------------------------------------ parameters
    def init_params(self, seed: int) -> None:
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
            ranges = zero_slices(buffer.size, dp)
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

    def master_buffer(self) -> FlatBuffer:
        """The FlatBuffer in the master dtype to write this rank's whole parameters into (init, resume):
        the parameters themselves, or, when the master weights are a ZeRO-1 slice, a transient host
        buffer that `adopt_master` then takes the slice and the compute copy from."""
        return FlatBuffer(self.specs, self.pdtype, np) if self.master_separate else self.params

    def adopt_master(self, buffer: FlatBuffer) -> None:
        if buffer is self.params:
            return
        lo, hi = self.shard
        self.master[...] = self.xp.asarray(buffer.data[lo:hi])
        self.params.data[...] = self.xp.asarray(buffer.data)  # rounded to the compute dtype

    def master_range(self, lo: int, hi: int) -> Array:
        """The master weights of flat elements [lo, hi), which lie inside this rank's `shard`."""
        base = self.shard[0]
        return self.master[lo - base:hi - base]

    @property
    def param_bytes(self) -> int:
        """Bytes of weights this rank holds: the master weights (whole, or its ZeRO-1 slice) and, under
        mixed precision, the whole compute copy."""
        extra = self.cparams.data.nbytes if self.cparams.data.dtype != self.master.dtype else 0
        return int(self.master.nbytes if self.master_separate else self.params.data.nbytes) + int(extra)

    # ------------------------------------------------------------------ one stage, one micro-batch
    def _refresh_compute_params(self) -> None:
        if self.cparams is not self.params:
            self.cparams.data[...] = self.params.data

    def _stage_forward(self, x: Array, y: Array, h: Array | None, keep: bool = True, chunk: int = 0,
                       ) -> tuple[Array, Stash]:
        """Returns (h_out or loss, saved) of layer chunk `chunk` (the rank's only one under plain 1F1B).
        `h` is the received activation (None on the first virtual stage). With `keep`, `saved` holds
        what the recompute policy keeps for the backward."""
        P, tp_layers, B, T = self.cparams, self.tp_layers, x.shape[0], x.shape[1]
        first, last, layers = self._chunk(chunk)
        ids = self.xp.asarray(x.reshape(-1))
        if first:
            h = tp_layers.embed_forward(ids, P)
        saved: Stash = {"ids": ids, "layers": []}
        for i in layers:
            block = Block(i, P, tp_layers, self.rope, (B, T))
            with named_range(self.xp, f"layer {i} forward"):
                if not keep:
                    h, _ = block.forward(h)
                    continue
                # the first layer's input is the embedding lookup: without a collective, a policy
                # may look it up again from the token ids instead of keeping it
                input_is_lookup = first and i == layers[0] and tp_layers.embedding_is_local
                h, entry = self.policy.forward(block, h, input_is_lookup)
                saved["layers"].append(entry)
        if not last:
            return h, saved
        # without `keep` no backward follows: the head keeps nothing of the vocabulary's width either
        lean = not keep or self.policy.lean_head
        loss, saved["head"] = tp_layers.head_forward(h, self.xp.asarray(y.reshape(-1)), P, lean=lean)
        return loss, saved

    def _chunk(self, chunk: int) -> tuple[bool, bool, range]:
        """(holds the embedding, holds the head, layers) of this rank's layer chunk `chunk`."""
        return (self.first and chunk == 0, self.last and chunk == self.n_chunks - 1, self.chunks[chunk])

    def _stage_backward(self, dh: Array, saved: Stash, shape: tuple[int, int], scale: float,
                        on_bucket_done: Callable[[int | str], None], chunk: int = 0) -> Array:
        P, grads, tp_layers = self.cparams, self.grads, self.tp_layers
        first, last, layers = self._chunk(chunk)
        if last:
            dh = tp_layers.head_backward(saved.pop("head"), scale, P, grads)
            on_bucket_done("head")
        # each layer's saved entry is taken out of `saved` and the block's backward empties its
        # cache: activations leave memory layer by layer as the backward goes
        look_up: Callable[[], Array] = lambda: tp_layers.embed_forward(saved["ids"], P)  # noqa: E731
        for i in reversed(layers):
            block = Block(i, P, tp_layers, self.rope, shape)
            entry = saved["layers"].pop()
            with named_range(self.xp, f"layer {i} backward"):
                cache = self.policy.cache(block, entry, look_up)
                del entry
                dh = block.backward(dh, cache, grads)
            on_bucket_done(i)
        if first:
            tp_layers.embed_backward(saved["ids"], dh, grads)
            on_bucket_done("embed")
        return dh

    def _account_saved(self, saved_of_chunks: list[Stash]) -> None:
        """Bytes kept between forward and backward for one micro-batch (all of this rank's chunks):
        per layer, and in total."""
        seen: set[int] = set()
        per_layer: list[int] = []
        total = 0
        for saved in saved_of_chunks:
            layers = [_nbytes(entry, seen) for entry in saved["layers"]]
            per_layer += layers
            total += sum(layers) + _nbytes(saved, seen)
        self.saved_activation_bytes_per_layer, self.saved_activation_bytes = per_layer, total

    # ------------------------------------------------------------------ a whole step
    def forward_backward(self, micro_batches: Sequence[tuple[Array, Array]],
                         also_sum: Callable[[], Iterable[float]] | None = None) -> float:
        """Forward and backward of this dp rank's micro-batches [(x, y), ...] (int arrays [B, T]).

        Returns the mean loss over the global batch (the same value on every rank); gradients of the
        global mean loss are left in self.grads, summed over data parallelism, and their global norm
        in `grad_norm()`. Loss and norm are summed over all ranks in one host all-reduce at the end
        of the step; `also_sum()`, when given, returns more floats (counters, flags) to sum in the
        same call, read once the step's traffic is over: their sums are left in `self.summed`.
        """
        M = len(micro_batches)
        # on a GPU the loss and the gradient's squared norm reach the host together: the step's one
        # synchronisation, whatever the number of micro-batches
        loss_sum, grad_sq = read_to_host(self.xp, self.forward_backward_on_device(micro_batches))
        extra = list(also_sum()) if also_sum else []
        totals = self.grid.host.sum([loss_sum / M, grad_sq, *extra])
        self._grad_norm = float(np.sqrt(totals[1]))
        self.summed = totals[2:]
        return float(totals[0]) / self.grid.dp_size

    def forward_backward_on_device(self, micro_batches: Sequence[tuple[Array, Array]],
                                   ) -> tuple[float | Array, float | Array]:
        """`forward_backward` up to its read: (the sum of this rank's micro-batches' mean losses, this rank's
        part of the gradient's squared norm), on a GPU 0-d float64 device arrays nothing has read (a
        step captured in a CUDA graph reads them after each replay: boostmpi/train/graph_step.py). Token
        ids may be device arrays already (the graph's static inputs)."""
        xp, grid, data_parallel = self.xp, self.grid, self.data_parallel
        self._refresh_compute_params()
        self.grads.data[...] = 0
        data_parallel.begin_step()
        M = len(micro_batches)
        B, T = micro_batches[0][0].shape
        Cl = self.tp_layers.res_cols[1] - self.tp_layers.res_cols[0]
        scale = 1.0 / (B * T * M * grid.dp_size)
        saved, losses, sends = {}, [], []
        held, held_peak, first_mb = {}, 0, []  # bytes in flight (saved activations), for the accounting

        def bucket_done(key: int | str, mb: int) -> None:
            if mb == M - 1:  # the last micro-batch's backward has left this bucket: its gradient is final
                data_parallel.bucket_final(key)

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
                                           partial(bucket_done, mb=mb), chunk=chunk)
            if step.send is not None:
                out = xp.ascontiguousarray(out)
                sends.append((grid.pp.isend(out, step.send[0], tag=step.send[1]), out))
            elif kind == "F" and self.last and chunk == self.n_chunks - 1:
                losses.append(out)
        self.in_flight_activation_bytes = held_peak
        for req, _buf in sends:
            req.wait()
        data_parallel.finish_step(self.params)
        loss_sum = self._loss_sum(losses) if (self.last and grid.coords.tp == 0) else 0.0
        return loss_sum, self._grad_sq()

    def _loss_sum(self, losses: list[float | Array]) -> float | Array:
        """The sum of the micro-batches' mean losses (floats, or on a GPU float64 device scalars that stay there)."""
        if not losses or all(isinstance(v, float) for v in losses):
            return float(np.sum(losses))
        return self.xp.stack(losses).sum()

    def evaluate(self, x: Array | None, y: Array) -> float:
        """Forward only, through the pipeline: the sum over all data-parallel ranks of (mean loss of
        their batch x rows). Every rank must call it; a rank with nothing to evaluate passes x = None."""
        return self.evaluate_batches([None if x is None else (x, y)])[0]

    def evaluate_batches(self, batches: Sequence[tuple[Array, Array] | None]) -> list[float]:
        """Forward only, the batches pipelined through the stages: for each entry, the sum over all
        data-parallel ranks of (mean loss of their batch x rows). Every rank calls it with a list of
        the same length (the ranks of a data-parallel replica with the same batches); an entry is
        (x, y), or None where this replica has nothing to evaluate.

        A stage takes the next batch as soon as it has sent the last one on, so n batches cost about
        n + pp - 1 stage forwards, not n x pp; with chunks (virtual stages) each chunk's round of the
        batches follows the previous one round the ring of ranks. Sends are waited for only when
        more than pp are on their way (without chunks; with them, at the end of a block of
        EVAL_BLOCK batches, the order of the ring being what the receives follow, so the outputs
        held stay bounded), the losses are read from the device once a block and summed over the
        ranks in one call."""
        if len(batches) > EVAL_BLOCK:
            return [total for start in range(0, len(batches), EVAL_BLOCK)
                    for total in self.evaluate_batches(batches[start:start + EVAL_BLOCK])]
        xp, grid = self.xp, self.grid
        self._refresh_compute_params()
        Cl = self.tp_layers.res_cols[1] - self.tp_layers.res_cols[0]
        S, v = self.n_stages, self.n_chunks
        losses, sends = [], []
        for chunk in range(v):  # the activations go round the ring of ranks once per chunk
            j = chunk * S + self.stage  # the virtual stage
            for i, batch in enumerate(batches):
                if batch is None:
                    continue
                x, y = batch
                B, T = x.shape
                h = None
                if j > 0:
                    h = xp.empty((B * T, Cl), dtype=self.cdtype)
                    grid.pp.irecv(h, (self.stage - 1) % S, tag=message_tag(FORWARD, i, j - 1, S, v)).wait()
                # only the output is held: the next batch's forward starts with nothing else of this one
                out = self._stage_forward(x, y, h, keep=False, chunk=chunk)[0]
                if j < S * v - 1:
                    out = xp.ascontiguousarray(out)
                    sends.append((grid.pp.isend(out, (self.stage + 1) % S, tag=message_tag(FORWARD, i, j, S, v)), out))
                    if v == 1 and len(sends) > S:  # the next stage takes them in order
                        sends.pop(0)[0].wait()
                elif grid.coords.tp == 0:
                    losses.append((i, out, B))
        for req, _buf in sends:
            req.wait()
        mine = [0.0] * len(batches)
        for (i, _, B), value in zip(losses, read_to_host(xp, [out for _, out, _ in losses])):
            mine[i] = value * B
        return [float(total) for total in self.grid.host.sum(mine)] if batches else []

    # ------------------------------------------------------------------ the gradient's norm
    def _grad_sq(self) -> Array:
        """This rank's part of the squared norm of the dp-summed gradient (each element counted once); on
        a GPU a device scalar that forward_backward reads with the loss."""
        return self.data_parallel.squared_norm_part(self.specs, self.grid.coords.tp, self.xp)

    def grad_norm(self) -> float:
        """Global L2 norm of the dp-summed gradient of the last forward_backward."""
        return self._grad_norm
