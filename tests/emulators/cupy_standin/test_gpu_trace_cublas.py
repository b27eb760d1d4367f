"""The stand-in's cuBLAS GEMMs take part in the stream-order tracking (cupy/cuda/_order.py).

A GEMM is device work on the stream of its handle (the current stream, as CuPy's binding sets
it): it reads A and B and writes C there. A GEMM on a side stream that reads an operand the
current stream wrote, or writes an output the current stream still reads, without an event
wait, is reported naming both sides; the same calls ordered by the wait pass. The mutation test
takes the report of the accesses out of the cuBLAS model and shows the race goes unseen.
"""

import numpy as np
import pytest

from tests.support.gpu_setup import GPU

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not GPU.standin, reason="checks the CuPy stand-in; a real GPU is in use")]


@pytest.fixture
def cp():
    import cupy

    from cupy.cuda import _order

    assert _order.ENABLED, "the stand-in's order tracking is off (BOOSTMPI_STANDIN_TRACK=0)"
    yield cupy
    cupy.cuda.Device().synchronize()


def _gemm(cp, a, b, c, stream):
    """c = a @ b (float32, row-major) through gemmEx on `stream` (the binding runs on the current stream)."""
    from cupy.cuda import cublas, runtime

    m, k = a.shape
    n = b.shape[1]
    one, zero = np.ones(1, np.float32), np.zeros(1, np.float32)
    with stream:
        cublas.gemmEx(cp.cuda.get_cublas_handle(), cublas.CUBLAS_OP_N, cublas.CUBLAS_OP_N, n, m, k,
                      one.ctypes.data, b.data.ptr, runtime.CUDA_R_32F, n, a.data.ptr, runtime.CUDA_R_32F, k,
                      zero.ctypes.data, c.data.ptr, runtime.CUDA_R_32F, n, cublas.CUBLAS_COMPUTE_32F,
                      cublas.CUBLAS_GEMM_DEFAULT)


def _race_on_a(cp):
    """A written on the current stream, then read by a GEMM on a side stream that did not wait."""
    a = cp.ones((4, 3), dtype=np.float32)
    b, c = cp.ones((3, 5), dtype=np.float32), cp.empty((4, 5), dtype=np.float32)
    side = cp.cuda.Stream(non_blocking=True)
    return a, b, c, side


def test_a_gemm_reads_its_operands_on_its_stream(cp):
    from cupy.cuda._order import StreamOrderError

    a, b, c, side = _race_on_a(cp)
    with pytest.raises(StreamOrderError, match=r"cuBLAS gemmEx \(A read\) on stream .* written by cupy.ones"):
        _gemm(cp, a, b, c, side)  # cuBLAS's A is the row-major b (the operands swap places)
    cp.cuda.Device().synchronize()
    a *= 2  # now only the row-major a is unordered: cuBLAS's B
    with pytest.raises(StreamOrderError, match=r"cuBLAS gemmEx \(B read\) on stream .* written by ndarray.__imul__"):
        _gemm(cp, a, b, c, side)
    side.wait_event(cp.cuda.get_current_stream().record())
    _gemm(cp, a, b, c, side)
    cp.cuda.get_current_stream().wait_event(side.record())
    assert float(c.sum()) == 4 * 5 * 6.0


def test_a_gemm_writes_its_output_on_its_stream(cp):
    from cupy.cuda._order import StreamOrderError

    a, b, c, side = _race_on_a(cp)
    side.wait_event(cp.cuda.get_current_stream().record())
    _gemm(cp, a, b, c, side)
    with pytest.raises(StreamOrderError,
                       match=r"ndarray.sum on stream 0x0 .* reads .* written by cuBLAS gemmEx \(C written\)"):
        c.sum()  # the current stream reads C before waiting for the side stream
    cp.cuda.get_current_stream().wait_event(side.record())
    c.sum()
    d = cp.ones((4, 5), dtype=np.float32)
    side2 = cp.cuda.Stream(non_blocking=True)
    side2.wait_event(cp.cuda.get_current_stream().record())  # a, b and d as written so far
    d.sum()  # read on the current stream after that: a GEMM writing d on side2 must wait for it
    with pytest.raises(StreamOrderError, match=r"cuBLAS gemmEx \(C written\) .* writes"):
        _gemm(cp, a, b, d, side2)


def test_mutant_without_the_gemm_accesses_misses_the_race(cp, monkeypatch):
    """The model with its access report taken out (the mutant): the unordered read goes unseen."""
    from cupy.cuda import cublas

    monkeypatch.setattr(cublas, "_accesses", lambda state, entry, operands: None)
    a, b, c, side = _race_on_a(cp)
    _gemm(cp, a, b, c, side)  # no error: the check depends on the model's report
    cp.cuda.get_current_stream().wait_event(side.record())
