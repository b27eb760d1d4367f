"""boostmpi/parallel/mappings.py: each region mapping, both directions, on a tp group of several ranks.

The ranks of a group are threads of this process (`Ranks`): each member's collective hands its buffer
to the others at a barrier and computes MPI's result from all of them, so every mapping runs on p
members at once with the data of a real layout. The group of one is the product's own
`comm.Group` without a communicator. Under mpiexec (`-m mpi`) the same round trips run on
`comm.Group` over MPI_COMM_WORLD.
"""

import threading

import numpy as np
import pytest

from boostmpi.parallel import mappings as M
from boostmpi.parallel.comm import CommCounter, Group


class Ranks:
    """p members of one group; `run(fn)` calls fn(member) on each in its own thread, returns the results
    in rank order (and re-raises the first member's exception)."""

    def __init__(self, size):
        self.size = size
        self.barrier = threading.Barrier(size, timeout=30)
        self.slots = [None] * size
        self.calls = []

    def run(self, fn):
        results, errors = [None] * self.size, []

        def body(rank):
            try:
                results[rank] = fn(Member(self, rank))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller below
                errors.append(exc)
                self.barrier.abort()

        threads = [threading.Thread(target=body, args=(r,)) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results


class Member:
    """One rank's view of the group: the collectives the mappings call, with MPI's semantics."""

    def __init__(self, ranks, rank):
        self.ranks, self.rank, self.size = ranks, rank, ranks.size

    def _exchange(self, call, buf):
        if self.rank == 0:
            self.ranks.calls.append(call)
        self.ranks.slots[self.rank] = np.array(buf, copy=True)
        self.ranks.barrier.wait()
        every = list(self.ranks.slots)
        self.ranks.barrier.wait()  # nobody overwrites a slot before all have read it
        return every

    def allreduce(self, buf, op="sum"):
        every = self._exchange(f"allreduce-{op}", buf)
        buf[...] = np.max(every, axis=0) if op == "max" else np.sum(every, axis=0)
        return buf

    def allreduce_many(self, bufs):
        for buf in bufs:
            buf[...] = np.sum(self._exchange("allreduce_many", buf), axis=0)
        return bufs

    def iallreduce(self, buf):
        total = np.sum(self._exchange("iallreduce", buf), axis=0)  # in step with the others

        class Request:
            def wait(self):
                buf[...] = total

        return Request()

    def allgather(self, buf):
        return np.stack(self._exchange("allgather", buf))


RNG = np.random.default_rng(7)


def test_copy_to_is_the_identity_and_its_backward_sums_every_ranks_partial_gradients():
    x = RNG.standard_normal((4, 6))
    grads = [[RNG.standard_normal((4, 6)), RNG.standard_normal(3).astype(np.float32)] for _ in range(3)]
    want = [sum(g[i] for g in grads) for i in range(2)]
    group = Ranks(3)

    def rank_side(tp):
        assert M.copy_to_tp_region(x, tp) is x
        mine = [g.copy() for g in grads[tp.rank]]
        M.copy_to_tp_region_backward_async(mine, tp).wait()
        return mine

    for got in group.run(rank_side):
        np.testing.assert_allclose(got[0], want[0], rtol=1e-12)
        np.testing.assert_allclose(got[1], want[1], rtol=1e-6)
        assert got[1].dtype == np.float32
    assert group.calls == ["iallreduce", "iallreduce"]


@pytest.mark.parametrize("op", ["sum", "max"])
def test_reduce_from_all_reduces_the_partial_outputs_in_place_and_its_backward_is_the_identity(op):
    partial = [RNG.standard_normal((5, 4)) for _ in range(4)]
    want = np.max(partial, axis=0) if op == "max" else np.sum(partial, axis=0)

    def rank_side(tp):
        y = partial[tp.rank].copy()
        out = M.reduce_from_tp_region(y, tp, op=op) if op == "max" else M.reduce_from_tp_region(y, tp)
        dy = RNG.standard_normal(3)
        assert M.reduce_from_tp_region_backward(dy, tp) is dy
        return out, y

    for out, y in Ranks(4).run(rank_side):
        assert out is y
        np.testing.assert_allclose(y, want, rtol=1e-12)


def test_reduce_from_many_sums_buffers_of_several_dtypes_in_one_call():
    parts = [[RNG.standard_normal(5), RNG.standard_normal((2, 2)).astype(np.float32)] for _ in range(2)]
    group = Ranks(2)
    results = group.run(lambda tp: M.reduce_from_tp_region_many([b.copy() for b in parts[tp.rank]], tp))
    for got in results:
        np.testing.assert_allclose(got[0], parts[0][0] + parts[1][0], rtol=1e-12)
        np.testing.assert_allclose(got[1], parts[0][1] + parts[1][1], rtol=1e-6)
    assert group.calls == ["allreduce_many", "allreduce_many"]  # one mapping call, the group's one collective


def test_gather_from_joins_the_column_shards_in_rank_order():
    shards = [RNG.standard_normal((3, 2)) + 10 * r for r in range(3)]
    for got in Ranks(3).run(lambda tp: M.gather_from_tp_region(shards[tp.rank], tp)):
        assert got.shape == (3, 6) and got.flags.c_contiguous
        np.testing.assert_array_equal(got, np.concatenate(shards, axis=-1))


@pytest.mark.parametrize("columns", [7, 6, 2])
def test_scatter_to_gives_each_rank_its_contiguous_columns_the_first_ones_one_wider(columns):
    x = RNG.standard_normal((2, 3, columns))
    pieces = Ranks(3).run(lambda tp: M.scatter_to_tp_region(x, tp))
    base, extra = divmod(columns, 3)
    assert [p.shape[-1] for p in pieces] == [base + (r < extra) for r in range(3)]
    assert all(p.flags.c_contiguous for p in pieces)
    np.testing.assert_array_equal(np.concatenate(pieces, axis=-1), x)


def test_gather_and_scatter_are_each_others_backward():
    full = RNG.standard_normal((4, 8))
    dy = RNG.standard_normal((4, 8))

    def rank_side(tp):
        mine = M.scatter_to_tp_region(full, tp)
        back = M.gather_from_tp_region_backward(dy, tp)
        return M.gather_from_tp_region(mine, tp), back

    for r, (round_trip, back) in enumerate(Ranks(4).run(rank_side)):
        np.testing.assert_array_equal(round_trip, full)
        np.testing.assert_array_equal(back, dy[:, 2 * r:2 * r + 2])


def test_a_group_of_one_moves_nothing_and_every_mapping_is_the_identity():
    counter = CommCounter()
    tp = Group("tp", None, counter)
    x = RNG.standard_normal((3, 5))
    before = x.copy()
    assert M.copy_to_tp_region(x, tp) is x
    M.copy_to_tp_region_backward_async([x], tp).wait()
    assert M.reduce_from_tp_region(x, tp) is x
    assert M.reduce_from_tp_region(x, tp, op="max") is x
    assert M.reduce_from_tp_region_many([x], tp)[0] is x
    assert M.gather_from_tp_region(x, tp) is x
    assert M.scatter_to_tp_region(x, tp) is x
    assert M.gather_from_tp_region_backward(x, tp) is x
    np.testing.assert_array_equal(x, before)
    assert counter.bytes["tp"] == 0 and counter.calls["tp"] == 0


@pytest.mark.mpi
def test_the_round_trips_on_the_world_group_over_mpi():
    from tests.support.mpi_helpers import assert_all_ranks, world

    comm = world()
    tp = Group("tp", comm.Dup(), CommCounter())
    p, r = tp.size, tp.rank
    full = np.arange(4.0 * (2 * p + 1)).reshape(4, 2 * p + 1)
    mine = M.scatter_to_tp_region(full, tp)
    a, b = (0, 3) if r == 0 else (2 * r + 1, 2 * r + 3)  # 2p + 1 columns: rank 0 holds the one extra
    ok = np.array_equal(mine, full[:, a:b])
    grads = [np.full(3, float(r + 1))]
    M.copy_to_tp_region_backward_async(grads, tp).wait()
    ok = ok and np.array_equal(grads[0], np.full(3, p * (p + 1) / 2))
    even = full[:, :2 * p]
    ok = ok and np.array_equal(M.gather_from_tp_region(np.ascontiguousarray(even[:, 2 * r:2 * r + 2]), tp), even)
    tp.comm.Free()
    assert_all_ranks(ok, "a mapping's result differs from its definition on this rank")
