"""Region mappings: how a tensor enters and leaves the tensor-parallel region.

The names are Megatron-LM's. Each direction of each mapping is one collective (or none) on the
tp group; the forward is the function of the mapping's name, the backward `<name>_backward`:

  mapping                  forward                          backward
  copy_to_tp_region        identity                         all-reduce (sum)
  reduce_from_tp_region    all-reduce (sum, or max)         identity
  gather_from_tp_region    all-gather along the last dim    split: this rank's columns
  scatter_to_tp_region     split: this rank's columns       all-gather along the last dim

A replicated input that a column-parallel factor reads is *copied to* the region; the partial
output of a row-parallel factor is *reduced from* it; btp's residual shards are *gathered from*
it for the head. copy_to's backward exists only started (`copy_to_tp_region_backward_async`,
returning a request to `.wait()` on before reading the buffers), so the weight-gradient GEMMs run
while it travels; scatter_to's backward is gather_from's forward. With a group of one every
mapping is the identity and moves nothing.
"""

from __future__ import annotations

from boostmpi.arrays import Array
from boostmpi.backend import get_array_module
from boostmpi.model.params import split_range
from boostmpi.parallel.comm import Communicator, Request


def copy_to_tp_region(x: Array, tp: Communicator) -> Array:
    """forward: identity (every rank reads the same x).  backward: copy_to_tp_region_backward_async."""
    return x


def copy_to_tp_region_backward_async(grads: list[Array], tp: Communicator) -> _Requests:
    """backward of copy_to_tp_region, started for each array in `grads`: the partial input
    gradients of all ranks; wait() on the result sums them in place."""
    return _Requests([tp.iallreduce(g) for g in grads])


def reduce_from_tp_region(y: Array, tp: Communicator, op: str = 'sum') -> Array:
    """forward: all-reduce of the partial outputs in place (op "sum", or "max" for a statistic).
    backward: identity (reduce_from_tp_region_backward)."""
    return tp.allreduce(y, op=op)


def reduce_from_tp_region_many(ys: list[Array], tp: Communicator) -> list[Array]:
    """reduce_from_tp_region (sum) of several buffers, of any dtypes, as one collective."""
    return tp.allreduce_many(ys)


def reduce_from_tp_region_backward(dy: Array, tp: Communicator) -> Array:
    """backward of reduce_from_tp_region: every rank already holds the whole gradient."""
    return dy


def gather_from_tp_region(x: Array, tp: Communicator) -> Array:
    """forward: [N, c] shards -> [N, c * p], rank order along the last dim.  backward: scatter_to_tp_region."""
    if tp.size == 1:
        return x
    xp = get_array_module(x)
    parts = tp.allgather(x)  # [p, N, c]
    return xp.ascontiguousarray(parts.transpose(1, 0, 2).reshape(x.shape[0], -1))


def gather_from_tp_region_backward(dy: Array, tp: Communicator) -> Array:
    """backward of gather_from_tp_region: this rank's columns of the gradient."""
    return scatter_to_tp_region(dy, tp)


def scatter_to_tp_region(x: Array, tp: Communicator) -> Array:
    """forward: this rank's contiguous columns of x [N, C] (the first C mod p ranks one wider).
    backward: gather_from_tp_region."""
    if tp.size == 1:
        return x
    a, b = split_range(x.shape[-1], tp.size, tp.rank)
    return get_array_module(x).ascontiguousarray(x[..., a:b])


class _Requests:
    """Several started collectives, completed together by `wait()`."""

    def __init__(self, reqs: list[Request]) -> None:
        self.reqs = reqs

    def wait(self) -> None:
        for r in self.reqs:
            r.wait()
