"""Memory one rank of `boostmpi train` needs: the step model's figure plus what it leaves out.

The step model (`model.py`) counts what lives through a step on a device: parameters, gradients,
the AdamW moments and the saved activations of the largest pipeline stage. A process running
the engine holds more, and the start-up memory check (boostmpi/parallel/startup.py) compares all
of it with what a rank may use, so that a model the check admits is not ended by the
out-of-memory killer. Every term below is read off the engine's own code and shapes:

* `optimizer_scratch` (both paths): AdamW's scratch buffer and the clipped gradient
  (boostmpi/train/optim.py), each as large as the moments' slice, allocated once on the device
  the optimizer runs on.
* `step_temporaries` (CPU path): the largest transient of a micro-batch beyond its saved
  activations (the LM head makes its probabilities in the logits' own buffer, which the activations
  count, so it has none of the vocabulary's width): a layer's backward at an input
  projection: seven arrays of the residual's width (the residual's gradient, the RMSNorm
  backward's intermediates, the result and the sum) and the gradients projected (dq, dk, dv and
  the attention's score tiles, or those of the gate and up outputs); with recompute, the
  probability tiles a forward run again hands to the backward that follows
  (boostmpi/model/layers.py, ATTENTION_KEEP_BYTES).
* `checkpoint` (CPU path): the writer's staging buffer (kept for the next save) or, for an
  asynchronous save, the snapshot of this rank's file; and the copy of the largest tensor piece
  a synchronous save makes between steps, when the activations are gone.
* `process` (CPU path): the interpreter with NumPy, mpi4py, h5py and boostmpi loaded, their
  allocations outside NumPy arrays, and room for the allocator's fragmentation (PROCESS_BYTES).

The GPU path's kernels fuse the head's softmax and the attention (no tiles, no exponentials
buffer), so only `optimizer_scratch` is added to its device memory; `boostmpi sim` itself keeps
reporting the step model's figure.
"""

from collections.abc import Mapping
from typing import TYPE_CHECKING

from boostmpi.model.layers import ATTENTION_BLOCK, ATTENTION_KEEP_BYTES, probability_tile_bytes
from boostmpi.model.params import param_specs
from boostmpi.precision import statistic_dtype
from boostmpi.sim.costs import ITEMSIZE
from boostmpi.sim.operations import Attention, Pointwise, shape_of
from boostmpi.sim.plans import layer_plan, plan_strategy

if TYPE_CHECKING:
    from boostmpi.config import Config

# The resident memory of a rank of `boostmpi train` that is not its NumPy arrays: a tiny model's whole
# peak is 92-94 MiB on 1 and 2 ranks on the MPICH wheel (bench/log/memory_estimate.md, 2026-11-28;
# 109-112 MiB while every rank imported CuPy). 160 MiB leaves room for a larger MPI library and for
# the heap: which arrays glibc serves from its heap moves a peak by tens of MiB (the same log).
PROCESS_BYTES = 160 * 2**20


def master_itemsize(dtype: str) -> int:
    from boostmpi.precision import master_dtype_name

    return ITEMSIZE[master_dtype_name(dtype)]


def optimizer_scratch(cfg: "Config", memory: Mapping[str, int]) -> int:
    """AdamW's scratch buffer, and the clipped gradient when train.grad_clip > 0 (optim.py): each
    the size of one moment, memory['optimizer'] / 2."""
    return (1 + (cfg.train.grad_clip > 0)) * memory["optimizer"] // 2


def step_temporaries(cfg: "Config") -> int:
    """Bytes one micro-batch holds on the CPU path beyond its saved activations, at the worst moment."""
    s = shape_of(cfg, "flash")
    e = ITEMSIZE[cfg.train.dtype]
    es = statistic_dtype(cfg.train.dtype).itemsize  # logits, softmax and score tiles
    N = s.N
    ops = layer_plan(s, plan_strategy(cfg))
    core = next(op for op in ops if isinstance(op, Attention))
    heads = core.heads // s.B  # local q heads
    qkv = core.saved - core.heads * core.T  # q, k, v of this rank: their gradients dq, dk, dv
    widths = [op.elements // N for op in ops if isinstance(op, Pointwise) and op.name == "gate*up"]  # the MLP's local d_ff
    residual = [op.elements // N for op in ops if isinstance(op, Pointwise) and op.name == "residual"]  # local residual width
    tile = s.B * heads * min(s.T, ATTENTION_BLOCK) * s.T * es  # scores of one query block
    # a layer's backward at an input projection (Block.backward): the residual's gradient dh, the
    # projection's result and the sum dh + result, the RMSNorm backward's four intermediates of the
    # residual's width (dxw in the softmax dtype, dxw * w, 2 x, 2 x * dS: layers.btp_norm_backward_post,
    # as many in layers.rmsnorm_backward), and the gradients it projects: dq, dk, dv (with the
    # attention's tiles: a score tile, its gradient and a cast), or dgate and dup
    width = max(residual)
    incoming = max(qkv * e + 3 * tile, 2 * N * max(widths) * e)
    layer = N * width * (3 * e + 4 * es) + incoming
    # the head's logits are made into the probabilities in their own buffer (vocab_parallel.head_forward),
    # which the activations count (the saved probabilities; under lowrank the lean head makes them again
    # in the backward, one at a time): no transient of the vocabulary's width besides
    kept_tiles = 0
    if cfg.train.recompute != "none":  # a forward run again hands its probability tiles to the backward
        kept = probability_tile_bytes(s.B, heads, s.T, cfg.train.dtype)
        kept_tiles = kept if kept <= ATTENTION_KEEP_BYTES else 0
    return layer + kept_tiles


def checkpoint_buffers(cfg: "Config") -> tuple[int, int]:
    """(bytes held from the first save on, bytes a synchronous save copies between steps): the
    writer's staging buffer, or the asynchronous save's image of this rank's file (parameters and
    both moments of its data-parallel share, boostmpi/checkpoint/writer.py); a synchronous save
    copies one tensor piece at a time (tp rank 0 holds the largest pieces)."""
    from boostmpi.checkpoint.writer import SequentialWriter

    em, par = master_itemsize(cfg.train.dtype), cfg.parallel
    stages = [[spec.local_numel for spec in param_specs(cfg, 0, st)] for st in range(par.pp)]
    if cfg.checkpoint.async_:
        share = max(-(-sum(sizes) // par.dp) for sizes in stages)
        return 3 * share * em, 0
    return SequentialWriter.STAGING, max(max(sizes) for sizes in stages) * em


def rank_memory(cfg: "Config", memory: Mapping[str, int]) -> dict[str, int]:
    """The check's estimate: `memory` (the step model's params, grads, optimizer, activations) plus
    the terms above, {..., 'workspace', 'total'} in bytes; on the GPU path only the optimizer's
    scratch is added (it is on the device; the rest of the workspace is the host's)."""
    out = {k: memory[k] for k in ("params", "grads", "optimizer", "activations")}
    scratch = optimizer_scratch(cfg, memory)
    if cfg.train.device == "gpu":
        out["workspace"] = scratch
    else:
        held, copied = checkpoint_buffers(cfg)
        during_step = memory["activations"] + step_temporaries(cfg)
        between_steps = max(during_step, copied)  # a synchronous save runs when the activations are freed
        out["workspace"] = scratch + PROCESS_BYTES + held + between_steps - memory["activations"]
    out["total"] = sum(out.values())
    return out
