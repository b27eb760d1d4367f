"""Stream order on the CuPy stand-in: the happens-before tracking (cupy/cuda/_order.py) and NCCL's ring order.

In-process: each rule of the tracking, shown by an access it must report and the same access made
safe by the event wait, stream synchronize or host synchronize a GPU needs. Under mpiexec
(tests/support/gpu_order_checks.py, each run under a timeout): the engine's own stream dependencies (a
2-stage NCCL pipeline, tensor parallelism over CUDA-aware MPI) hold with the tracking on, and
fail, naming both sides, when one of them is taken out of the engine's source text; bf16 and fp16
NCCL sums over 4 ranks follow the ring's order and its p-1 roundings, and a stand-in rounding
once is caught.
"""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.support.gpu_setup import GPU
from tests.support.mpi_helpers import MPIEXEC

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not GPU.standin, reason="checks the CuPy stand-in; a real GPU is in use")]
SUPPORT = Path(__file__).resolve().parents[2] / "support"


@pytest.fixture
def cp():
    import cupy

    from cupy.cuda import _order

    assert _order.ENABLED, "the stand-in's order tracking is off (BOOSTMPI_STANDIN_TRACK=0)"
    yield cupy
    cupy.cuda.Device().synchronize()  # what a test left on its side streams is done before the next one


def _side():
    import cupy

    return cupy.cuda.Stream(non_blocking=True)


def _filled_on(stream, cp, value=1.0, n=64):
    """An array written on `stream` (which first waits for the current stream)."""
    stream.wait_event(cp.cuda.get_current_stream().record())
    with stream:
        return cp.full(n, value, dtype=np.float32)


def test_a_read_on_another_stream_without_a_wait_is_reported(cp):
    from cupy.cuda._order import StreamOrderError

    side = _side()
    a = _filled_on(side, cp)
    with pytest.raises(StreamOrderError) as report:
        a + 1
    text = str(report.value)
    assert "cupy.full on stream" in text and "ndarray.__add__ on stream 0x0" in text  # both sides
    assert "float32 array of shape (64,)" in text and "test_stream_order.py" in text  # the buffer, its site
    cp.cuda.get_current_stream().wait_event(side.record())
    assert float((a + 1).sum()) == 128.0


@pytest.mark.parametrize("how", ["stream synchronize", "event synchronize", "device synchronize"])
def test_a_host_synchronize_orders_everything_issued_after_it(cp, how):
    side = _side()
    a = _filled_on(side, cp)
    if how == "stream synchronize":
        side.synchronize()
    elif how == "event synchronize":
        side.record().synchronize()
    else:
        cp.cuda.Device().synchronize()
    assert float((a * 2).sum()) == 128.0


def test_a_write_must_follow_the_reads_of_other_streams(cp):
    from cupy.cuda._order import StreamOrderError

    a = cp.ones(64, dtype=np.float32)
    side = _side()
    side.wait_event(cp.cuda.get_current_stream().record())
    with side:
        total = a.sum()  # reads a on the side stream
    with pytest.raises(StreamOrderError, match="writes .* which was read by ndarray.sum"):
        a[...] = 2.0
    cp.cuda.get_current_stream().wait_event(side.record())
    a[...] = 2.0
    assert float(total) == 64.0


def test_writes_to_disjoint_slices_need_no_order_but_overlapping_ones_do(cp):
    from cupy.cuda._order import StreamOrderError

    a = cp.zeros(64, dtype=np.float32)
    side = _side()
    side.wait_event(cp.cuda.get_current_stream().record())
    with side:
        a[:32] = 1.0
    a[32:] = 2.0  # other bytes of the same allocation: no conflict
    with pytest.raises(StreamOrderError, match=r"bytes 60\.\.132"):
        a[15:33] = 3.0


def test_views_and_no_op_conversions_launch_nothing(cp):
    """Slicing, reshape, transpose and asarray of a device array touch no memory: no order is needed."""
    from cupy.cuda._order import StreamOrderError

    side = _side()
    a = _filled_on(side, cp)
    views = [a[3:9], a.reshape(8, 8).T, cp.asarray(a), a.astype(np.float32, copy=False), cp.ascontiguousarray(a)]
    assert all(v.data.mem is a.data.mem for v in views)
    with pytest.raises(StreamOrderError):
        a.copy()  # a copy is device work
    cp.cuda.get_current_stream().wait_event(side.record())


def test_get_copies_on_the_current_stream_and_synchronizes_it(cp):
    from cupy.cuda._order import StreamOrderError

    side = _side()
    a = _filled_on(side, cp)
    with pytest.raises(StreamOrderError, match="ndarray.get"):
        a.get()
    assert a.get(stream=side).sum() == 64.0  # on the stream that wrote it: ordered, and synchronized
    c = _filled_on(side, cp, 2.0)
    assert cp.asnumpy(c, stream=side).sum() == 128.0
    b = _filled_on(side, cp, 3.0)
    side.synchronize()
    assert float(b[0]) == 3.0 and cp.asnumpy(b).sum() == 192.0


def test_set_copies_from_the_host_on_its_stream(cp):
    from cupy.cuda._order import StreamOrderError

    a = cp.zeros(16, dtype=np.float32)
    side = _side()
    side.wait_event(cp.cuda.get_current_stream().record())
    with side:
        a.sum()
    host = np.arange(16, dtype=np.float32)
    with pytest.raises(StreamOrderError, match="ndarray.set on stream 0x0 .* writes .* read by ndarray.sum"):
        a.set(host)
    a.set(host, stream=side)  # on the stream that read it: ordered
    cp.cuda.get_current_stream().wait_event(side.record())
    assert a.get().tolist() == host.tolist()


def test_cuda_aware_mpi_needs_the_producing_stream_synchronized(cp):
    """mpi4py takes device buffers through __cuda_array_interface__ and waits for no stream."""
    from cupy.cuda._order import StreamOrderError

    a = cp.ones(16, dtype=np.float32) * 2
    with pytest.raises(StreamOrderError, match="CUDA-aware MPI .* reads or writes .* written by ndarray.__mul__"):
        a.__cuda_array_interface__
    cp.cuda.get_current_stream().synchronize()
    assert a.__cuda_array_interface__["shape"] == (16,)
    b = a + 1  # issued after MPI's access: ordered after it
    assert float(b[0]) == 3.0


def test_a_reused_pool_block_remembers_its_last_users(cp):
    """CuPy's pool hands a freed block to the next allocation on the same stream at once: a side
    stream still reading it must have been waited for."""
    from cupy.cuda._order import StreamOrderError

    a = cp.ones(1000, dtype=np.float32)
    side = _side()
    side.wait_event(cp.cuda.get_current_stream().record())
    with side:
        total = a.sum()
    ptr = a.data.ptr
    del a
    with pytest.raises(StreamOrderError, match="read by ndarray.sum on stream"):
        b = cp.full(1000, 5.0, dtype=np.float32)
    b = None
    cp.cuda.get_current_stream().wait_event(side.record())
    b = cp.full(1000, 5.0, dtype=np.float32)
    assert b.data.ptr == ptr and float(total) == 1000.0


def test_the_legacy_null_stream_orders_blocking_streams(cp):
    blocking = cp.cuda.Stream()  # not non_blocking: ordered with the null stream both ways
    a = cp.ones(8, dtype=np.float32)
    with blocking:
        a *= 3
    assert float((a + 0).sum()) == 24.0


def test_a_kernel_writes_its_non_const_pointers_and_reads_the_const_ones(cp):
    from cupy.cuda._order import StreamOrderError

    kernel = cp.RawKernel(r'''extern "C" __global__ void twice(const float* x, float* y, int n) {
        int i = blockIdx.x * blockDim.x + threadIdx.x;
        if (i < n) y[i] = 2.0f * x[i];
    }''', "twice")
    x, y = cp.ones(32, dtype=np.float32), cp.zeros(32, dtype=np.float32)
    side = _side()
    side.wait_event(cp.cuda.get_current_stream().record())
    kernel((1,), (32,), (x, y, np.int32(32)), stream=side)
    x + 1  # x was only read on the side stream: reading it here needs no order
    with pytest.raises(StreamOrderError, match="written by kernel twice on stream"):
        y + 1
    cp.cuda.get_current_stream().wait_event(side.record())
    assert float(y.sum()) == 64.0


def test_an_nccl_operation_reads_and_writes_on_its_stream(cp):
    """A one-member communicator: an all-reduce on a side stream of a buffer the current stream wrote."""
    from cupy.cuda import nccl
    from cupy.cuda._order import StreamOrderError

    comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
    a = cp.ones(16, dtype=np.float32)
    side = _side()
    with pytest.raises(StreamOrderError, match="NCCL allReduce .* writes .* written by cupy.ones"):
        comm.allReduce(a.data.ptr, a.data.ptr, 16, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, side.ptr)
    comm2 = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
    side.wait_event(cp.cuda.get_current_stream().record())
    comm2.allReduce(a.data.ptr, a.data.ptr, 16, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, side.ptr)
    with pytest.raises(StreamOrderError, match="written by NCCL allReduce"):
        a.get()
    cp.cuda.get_current_stream().wait_event(side.record())
    assert a.get().sum() == 16.0
    comm.destroy(), comm2.destroy()


# ---------------------------------------------------------------- NCCL's ring order, in-process
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("size", [2, 3, 4])
def test_ring_sum_follows_the_simulated_ring(dtype, size):
    import ml_dtypes

    from cupy.cuda.nccl import ring_sum
    from tests.support.gpu_order_checks import simulate_ring_allreduce

    dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    rng = np.random.default_rng(size)
    parts = (rng.standard_normal((size, 101)) * 2.0 ** rng.integers(-3, 4, (size, 101))).astype(dt)
    got = ring_sum(parts, dt)
    assert got.tobytes() == simulate_ring_allreduce(parts, dt)[0].tobytes()
    if size == 2:  # two members: one addition, the same as rounding once
        assert got.tobytes() == parts.astype(np.float32).sum(0).astype(dt).tobytes()


# ---------------------------------------------------------------- under mpiexec: the engine, the ring, mutants
def _mpiexec(ranks, *args, device="a100"):
    import os

    assert MPIEXEC, "mpiexec not found (pip install mpich)"
    env = dict(os.environ, BOOSTMPI_STANDIN_GPU=device, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([MPIEXEC, "-n", str(ranks), sys.executable, str(SUPPORT / "gpu_order_checks.py"), *args],
                          capture_output=True, text=True, timeout=600, env=env)
    return proc.returncode, proc.stdout, proc.stderr


@pytest.mark.parametrize("check,ranks,mutant,report,device", [
    ("pp2", 2, None, None, "a100"),
    ("pp2", 2, None, None, "mi250x"),  # the multi-rank engine at 64 lanes
    # without the wait, the first unordered access is the send's read of the activations or (once the pool
    # hands the receive buffer bytes another stream-0 array wrote, as CuPy's pool does) the receive's write
    ("pp2", 2, "skip-p2p-wait", "NCCL (send|recv) of .* (reads|writes) the buffer .* written by .* on stream 0x0",
     "a100"),
    ("tp2-mpi", 2, None, None, "a100"),
    # the multi-rank engine at 64 lanes is pp2's above; tp2 over MPI at 64 lanes with the slow tests
    pytest.param("tp2-mpi", 2, None, None, "mi250x", marks=pytest.mark.slow),
    ("tp2-mpi", 2, "no-mpi-sync", "CUDA-aware MPI .* at boostmpi/parallel/comm.py:.* written by .* on stream 0x0",
     "a100"),
    ("pp2-dp2-zero1", 4, None, None, "a100"),
    ("ring", 4, None, None, "a100"),
    ("ring", 4, "round-once", "bfloat16: .* elements differ from NCCL's ring order", "a100"),
])
def test_engine_stream_order_and_ring_order_under_mpi(check, ranks, mutant, report, device):
    """The real code passes; each mutant (one change to the source text, in the ranks' processes) fails
    with the report that names it."""
    import re

    status, out, err = _mpiexec(ranks, check, *([mutant] if mutant else []), device=device)
    if report is None:
        assert status == 0 and out.strip().endswith("ok"), f"{out[-2000:]}\n{err[-6000:]}"
    else:
        assert status != 0 and re.search(report, err), f"mutant {mutant} was not caught:\n{out[-2000:]}\n{err[-6000:]}"
