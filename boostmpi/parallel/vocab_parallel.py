"""The vocabulary-parallel embedding, LM head and cross-entropy.

Tensor-parallel rank t holds the contiguous vocabulary range [v0, v1) = split_range(V, p, t)
(the first V mod p ranks one row wider): the rows [v0, v1) of the embedding table (under vanilla
and Megatron TP; btp shards the embedding along C instead) and the columns [v0, v1) of the LM head.
Neither the logits [N, V] nor the probabilities are ever gathered: the cross-entropy needs only
three numbers per token from the other ranks (the row maximum, the sum of exponentials and the
target's logit), which travel in two all-reduces.
"""

from typing import NamedTuple

import numpy as np

from boostmpi.backend import get_array_module
from boostmpi.model import layers
from boostmpi.parallel.mappings import (copy_to_tp_region_backward_async, reduce_from_tp_region)


# ---------------------------------------------------------------- embedding (rows [v0, v1) of the table)
def _local_ids(ids, v0, v1):
    xp = get_array_module(ids)
    mask = (ids >= v0) & (ids < v1)
    return xp.where(mask, ids - v0, 0), mask


def embedding_forward(table, ids, v0, v1, tp):
    """ids [N] -> h [N, C]: each rank looks up the ids in its range, zeros elsewhere, then
    reduce_from_tp_region (all-reduce forward, identity backward)."""
    local, mask = _local_ids(ids, v0, v1)
    h = layers.embedding_forward(table, local)
    if tp.size > 1:
        h *= mask[:, None]
        reduce_from_tp_region(h, tp)
    return h


def embedding_backward(dtable, ids, dh, v0, v1):
    local, mask = _local_ids(ids, v0, v1)
    layers.embedding_backward(dtable, local[mask], dh[mask])


# ---------------------------------------------------------------- final norm, logits, cross-entropy
class HeadCache(NamedTuple):
    """What the head's backward reads. A full cache holds the normalised input `n` and the
    probabilities; a lean one (recompute = "lowrank") holds only what came out of collectives,
    the softmax's row maximum and sum of exponentials, and the backward recomputes the rest."""
    h: object  # [N, C] the gathered residual
    rstd: object  # [N, 1] the final norm's statistic
    local: object  # [N] the target lies in this rank's vocabulary range
    tidx: object  # [N] the target's column in this rank's logits (0 where not local)
    n: object = None  # [N, C] final_norm(h), full cache only
    probs: object = None  # [N, V/p] softmax over the whole vocabulary, full cache only
    row_max: object = None  # [N] lean cache only
    sumexp: object = None  # [N] lean cache only


def _logits(n, lm_head):
    logits = n @ lm_head  # [N, V_local]
    return logits.astype(np.promote_types(logits.dtype, np.float32), copy=False)  # softmax and loss in >= fp32


def head_forward(h, targets, norm_w, lm_head, eps, v0, tp, lean=False):
    """h [N, C] (whole on every rank), targets [N] -> (mean cross-entropy over N, HeadCache)."""
    xp = get_array_module(h)
    n, rstd = layers.rmsnorm_forward(h, norm_w, eps)
    logits = _logits(n, lm_head)
    mx = reduce_from_tp_region(logits.max(axis=-1), tp, op="max")
    probs = xp.exp(logits - mx[:, None])
    local = (targets >= v0) & (targets < v0 + lm_head.shape[1])
    tidx = xp.where(local, targets - v0, 0)
    rows = xp.arange(len(targets))
    stats = xp.stack([probs.sum(axis=-1), xp.where(local, logits[rows, tidx], 0)], axis=1)
    reduce_from_tp_region(stats, tp)
    sumexp, target_logit = stats[:, 0], stats[:, 1]
    losses = xp.log(sumexp) + mx - target_logit
    if lean:
        return float(losses.mean()), HeadCache(h, rstd, local, tidx, row_max=mx, sumexp=sumexp)
    probs /= sumexp[:, None]
    return float(losses.mean()), HeadCache(h, rstd, local, tidx, n=n, probs=probs)


def head_backward(cache, scale, norm_w, lm_head, dnorm_w, dlm_head, tp):
    """d(loss)/d(h) for loss = scale * sum of per-token cross-entropy; accumulates into dnorm_w, dlm_head."""
    h, rstd, local, tidx, n, probs = cache.h, cache.rstd, cache.local, cache.tidx, cache.n, cache.probs
    xp = get_array_module(h)
    if n is None:  # lean cache: the same operations as the forward, from its saved statistics
        n = h * rstd * norm_w
        probs = xp.exp(_logits(n, lm_head) - cache.row_max[:, None])
        probs /= cache.sumexp[:, None]
    dlogits = probs
    rows = xp.arange(len(tidx))
    dlogits[rows[local], tidx[local]] -= 1.0
    dlogits *= scale
    dn = dlogits.astype(n.dtype, copy=False) @ lm_head.T  # partial over the vocabulary shards
    req = copy_to_tp_region_backward_async([dn], tp)  # n was copied to the region for the lm_head
    dlm_head += n.T @ dlogits
    req.wait()
    dh = layers.rmsnorm_backward(dn, h, norm_w, rstd, dnorm_w)
    return dh.astype(h.dtype, copy=False)
