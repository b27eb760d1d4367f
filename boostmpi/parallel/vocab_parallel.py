"""The vocabulary-parallel embedding, LM head and cross-entropy.

Tensor-parallel rank t holds the contiguous vocabulary range [v0, v1) = split_range(V, p, t)
(the first V mod p ranks one row wider): the rows [v0, v1) of the embedding table (under vanilla
and Megatron TP; btp shards the embedding along C instead) and the columns [v0, v1) of the LM head.
Neither the logits [N, V] nor the probabilities are ever gathered: the cross-entropy needs only
three numbers per token from the other ranks (the row maximum, the sum of exponentials and the
target's logit), which travel in two all-reduces.
"""

from __future__ import annotations

from types import ModuleType
from typing import NamedTuple

import numpy as np

from boostmpi.arrays import Array
from boostmpi.backend import get_array_module
from boostmpi.parallel.comm import Communicator
from boostmpi.model import layers
from boostmpi.parallel.mappings import (copy_to_tp_region_backward_async, reduce_from_tp_region)
from boostmpi.precision import statistic_dtype


# ---------------------------------------------------------------- embedding (rows [v0, v1) of the table)
def _local_ids(ids: Array, v0: int, v1: int) -> tuple[Array, Array]:
    xp = get_array_module(ids)
    mask = (ids >= v0) & (ids < v1)
    return xp.where(mask, ids - v0, 0), mask


def embedding_forward(table: Array, ids: Array, v0: int, v1: int, tp: Communicator) -> Array:
    """ids [N] -> h [N, C]: each rank looks up the ids in its range, zeros elsewhere, then
    reduce_from_tp_region (all-reduce forward, identity backward)."""
    local, mask = _local_ids(ids, v0, v1)
    h = layers.embedding_forward(table, local)
    if tp.size > 1:
        h *= mask[:, None]
        reduce_from_tp_region(h, tp)
    return h


def embedding_backward(dtable: Array, ids: Array, dh: Array, v0: int, v1: int) -> None:
    local, mask = _local_ids(ids, v0, v1)
    layers.embedding_backward(dtable, local[mask], dh[mask])


# ---------------------------------------------------------------- final norm, logits, cross-entropy
class HeadCache(NamedTuple):
    """What the head's backward reads. A full cache holds the normalised input `n` and the
    probabilities (or, on the fused-kernel path, the logits); a lean one (recompute = "lowrank")
    holds only what came out of collectives and the backward recomputes the rest."""
    h: Array  # [N, C] the gathered residual
    rstd: Array  # [N, 1] the final norm's statistic
    local: Array  # [N] the target lies in this rank's vocabulary range (None: the fused kernel's cache)
    tidx: Array  # [N] the target's column in this rank's logits (0 where not local)
    n: Array = None  # [N, C] final_norm(h), full cache only
    probs: Array = None  # [N, V/p] softmax over the whole vocabulary, full cache only
    row_max: Array = None  # [N] lean cache only
    sumexp: Array = None  # [N] lean cache only
    logits: Array = None  # [N, V] the fused kernel's full cache (its backward overwrites them)


def _logits(n: Array, lm_head: Array) -> Array:
    # [N, V_local], softmax and loss in >= fp32: from bfloat16 operands the GEMM's float32 accumulator itself
    return layers.matmul(n, lm_head, dtype=statistic_dtype(n.dtype))


def cross_entropy_forward(logits: Array, targets: Array, v0: int, tp: Communicator, normalise: bool = True,
                          overwrite: bool = False) -> tuple[Array, Array, Array, Array, Array, Array]:
    """logits [N, V/p] (this rank's vocabulary columns [v0, v0 + V/p)), targets [N] -> (loss per row
    [N], probs [N, V/p], row max [N], sum of exponentials [N], local [N], tidx [N]): probs is
    exp(logits - row max), divided by the sum over the whole vocabulary when `normalise`; with
    `overwrite` it is computed in the logits' own buffer (no [N, V/p] temporary: the head's logits
    are the largest arrays of a step). With a group of one it is the plain cross-entropy, the
    softmax_xent kernel's specification."""
    xp = get_array_module(logits)
    mx = reduce_from_tp_region(logits.max(axis=-1), tp, op="max")
    local = (targets >= v0) & (targets < v0 + logits.shape[1])
    tidx = xp.where(local, targets - v0, 0)
    rows = xp.arange(len(targets))
    target_logit = xp.where(local, logits[rows, tidx], 0)  # read before the buffer may be overwritten
    probs = _exp_shifted(logits, mx, out=logits if overwrite else None)
    stats = xp.stack([probs.sum(axis=-1), target_logit], axis=1)
    reduce_from_tp_region(stats, tp)
    sumexp, target_logit = stats[:, 0], stats[:, 1]
    losses = xp.log(sumexp) + mx - target_logit
    if normalise:
        probs /= sumexp[:, None]
    return losses, probs, mx, sumexp, local, tidx


def _exp_shifted(logits: Array, row_max: Array, out: Array | None = None) -> Array:
    """exp(logits - row_max[:, None]), element for element the same values whether into `out` (which
    may be `logits` itself) or into a new array."""
    xp = get_array_module(logits)
    shifted = xp.subtract(logits, row_max[:, None], out=out)
    return xp.exp(shifted, out=shifted)


def cross_entropy_backward(probs: Array, local: Array, tidx: Array, scale: float) -> Array:
    """dlogits = (probs - onehot(target)) * scale, in the buffer of the normalised `probs`."""
    xp = get_array_module(probs)
    rows = xp.arange(len(tidx))
    probs[rows[local], tidx[local]] -= 1.0
    probs *= scale
    return probs


def mean_loss(losses: Array) -> float | Array:
    """The mean of the per-token losses: a float on the CPU; on a GPU a 0-d float64 device array, so
    that a step of several micro-batches reads its loss in the one host synchronisation of the step
    (`Engine.forward_backward`) instead of once per micro-batch."""
    xp = get_array_module(losses)
    return float(losses.mean()) if xp is np else losses.mean(dtype=np.float64)


def _fused_xent(logits: Array, tp: Communicator) -> ModuleType | None:
    """The fused softmax_xent kernel (boostmpi.gpu.kernels) when the whole vocabulary is on this
    rank and the logits are on a GPU, else None. Under vocabulary parallelism the softmax needs the
    other ranks' row maximum and sum between its two passes, which one kernel launch cannot wait
    for: the plain operations above run there."""
    k, _ = layers.kernel_inputs(logits)
    return k if tp.size == 1 and k is not None else None


def head_forward(h: Array, targets: Array, norm_w: Array, lm_head: Array, eps: float, v0: int, tp: Communicator,
                 lean: bool = False) -> tuple[float | Array, HeadCache]:
    """h [N, C] (whole on every rank), targets [N] -> (mean cross-entropy over N, HeadCache); the mean
    as `mean_loss` gives it (a float, or on a GPU a device scalar)."""
    n, rstd = layers.rmsnorm_forward(h, norm_w, eps)
    logits = _logits(n, lm_head)
    k = _fused_xent(logits, tp)
    if k is not None:
        targets = targets.astype(np.int64, copy=False)
        losses, _ = k.softmax_xent(logits, targets)
        keep = {} if lean else dict(n=n, logits=logits)
        return mean_loss(losses), HeadCache(h, rstd, None, targets, **keep)
    losses, probs, mx, sumexp, local, tidx = cross_entropy_forward(logits, targets, v0, tp, normalise=not lean,
                                                                   overwrite=True)
    if lean:
        return mean_loss(losses), HeadCache(h, rstd, local, tidx, row_max=mx, sumexp=sumexp)
    return mean_loss(losses), HeadCache(h, rstd, local, tidx, n=n, probs=probs)


def head_backward(cache: HeadCache, scale: float, norm_w: Array, lm_head: Array, dnorm_w: Array, dlm_head: Array,
                  tp: Communicator) -> Array:
    """d(loss)/d(h) for loss = scale * sum of per-token cross-entropy; accumulates into dnorm_w, dlm_head."""
    h, rstd, n = cache.h, cache.rstd, cache.n
    if n is None:  # lean cache: the same operations as the forward, from its saved statistics
        n = (h * rstd * norm_w).astype(h.dtype, copy=False)  # as the forward's norm stores it
    if cache.local is None:  # the fused kernel's cache: the gradient overwrites the logits
        logits = cache.logits if cache.logits is not None else _logits(n, lm_head)
        kern = _fused_xent(logits, tp)
        assert kern is not None  # the forward took the fused kernel's path
        _, dlogits = kern.softmax_xent(logits, cache.tidx, grad_scale=scale, out=logits)
    else:
        probs = cache.probs
        if probs is None:
            logits = _logits(n, lm_head)
            probs = _exp_shifted(logits, cache.row_max, out=logits)
            probs /= cache.sumexp[:, None]
        dlogits = cross_entropy_backward(probs, cache.local, cache.tidx, scale)
    dlogits = dlogits.astype(n.dtype, copy=False)  # both GEMMs in the compute dtype (tensor cores for bf16)
    dn = layers.matmul(dlogits, lm_head.T)  # partial over the vocabulary shards
    req = copy_to_tp_region_backward_async([dn], tp)  # n was copied to the region for the lm_head
    layers.matmul(n.T, dlogits, out=dlm_head, accumulate=True)
    req.wait()
    dh = layers.rmsnorm_backward(dn, h, norm_w, rstd, dnorm_w)
    return dh.astype(h.dtype, copy=False)
