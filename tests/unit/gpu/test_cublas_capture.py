"""boostmpi/gpu/cublas_capture.py: the step's GEMMs while a CUDA graph is captured.

CuPy 14.2.0's cuBLAS binding raises NotImplementedError when it is called while CuPy's current stream
captures (cupy_backends/cuda/libs/cublas.pyx at v14.2.0, `setStream`). The tests model that refusal on
the stand-in's binding and stand in for the library's own functions with the stand-in's GEMM called
directly (as its hipBLAS stand-in calls it: on the stream the handle was given): without the routing
the capture fails as on a GPU, with it the captured step is bitwise the eager one. On a real GPU the
same two tests run CuPy's own refusal and libcublas's functions.
"""

import contextlib
import inspect

import pytest

from boostmpi.gpu import cublas_capture
from tests.unit.train.test_graph_step import assert_graph_steps_are_the_eager_steps, graph_run, small_config

pytestmark = pytest.mark.gpu

SINGLE = ("transa", "transb", "m", "n", "k", "alpha", "A", "Atype", "lda", "B", "Btype", "ldb", "beta", "C", "Ctype",
          "ldc", "computeType", "algo")
STRIDED = ("transa", "transb", "m", "n", "k", "alpha", "A", "Atype", "lda", "strideA", "B", "Btype", "ldb", "strideB",
           "beta", "C", "Ctype", "ldc", "strideC", "batchCount", "computeType", "algo")


def test_the_prototypes_take_the_bindings_arguments():
    """Each C prototype is the handle and the arguments of CuPy's binding function, in its order (the
    stand-in's binding carries CuPy's signatures, checked against its source); on a real GPU the library
    CuPy loaded has the three functions."""
    from tests.support.gpu_setup import GPU

    if not GPU.standin:
        assert all(cublas_capture.library())
        return
    import cupy.cuda.cublas as binding

    for name, c_name in (("gemmEx", "cublasGemmEx"), ("gemmStridedBatchedEx", "cublasGemmStridedBatchedEx")):
        params = list(inspect.signature(getattr(binding, name)).parameters)
        assert params == ["handle", *(SINGLE if name == "gemmEx" else STRIDED)]
        assert len(cublas_capture.PROTOTYPES[c_name]) == len(params)
    assert len(cublas_capture.PROTOTYPES["cublasSetStream_v2"]) == 2


@pytest.mark.parametrize("refuses", [True, False])
def test_the_binding_is_cupys_outside_a_capture_or_where_it_takes_one(monkeypatch, refuses):
    import cupy.cuda.cublas as binding

    monkeypatch.setattr(cublas_capture, "_refuses", refuses)
    assert cublas_capture.binding(binding) is binding
    with cublas_capture.capturing():
        assert cublas_capture.binding(binding) is (cublas_capture if refuses else binding)
        with cublas_capture.capturing():
            pass
        assert cublas_capture.binding(binding) is (cublas_capture if refuses else binding)
    assert cublas_capture.binding(binding) is binding


@pytest.fixture
def cupys_refusal(monkeypatch):
    """On the stand-in: CuPy's binding refusing a capturing stream, and the library's functions (GEMMs on
    the stream the handle was given); returns the GEMMs the library ran (None on a real GPU: CuPy's and
    libcublas's own)."""
    import cupy

    from tests.support.gpu_setup import GPU

    if not GPU.standin:
        return None
    import cupy.cuda.cublas as binding

    set_stream = binding.setStream

    def refusing(handle, stream):  # CuPy 14.2.0's setStream
        current = cupy.cuda.get_current_stream()
        if current.ptr == stream and current.is_capturing():
            raise NotImplementedError("calling cuBLAS API during stream capture is currently unsupported")
        set_stream(handle, stream)

    ran = []

    def gemm(handle, *args):
        given = dict(zip(SINGLE, args), handle=handle)
        binding._gemm(**binding._convert(given, strided=False), strideA=0, strideB=0, strideC=0, batchCount=1,
                      entry="gemmEx", direct=True)
        ran.append("single")
        return 0

    def gemm_strided(handle, *args):
        binding._gemm(**binding._convert(dict(zip(STRIDED, args), handle=handle), strided=True),
                      entry="gemmStridedBatchedEx", direct=True)
        ran.append("strided")
        return 0

    monkeypatch.setattr(binding, "setStream", refusing)
    monkeypatch.setattr(cublas_capture, "_refuses", None)  # asked again, of the refusing binding
    library = cublas_capture.Library(lambda handle, stream: (set_stream(handle, stream), 0)[1], gemm, gemm_strided)
    monkeypatch.setattr(cublas_capture, "library", lambda: library)
    return ran


def test_without_the_routing_cupys_binding_fails_the_capture(cupys_refusal, monkeypatch):
    monkeypatch.setattr(cublas_capture, "capturing", contextlib.nullcontext)
    with pytest.raises(NotImplementedError, match="during stream capture"):
        graph_run(small_config(), warmup=1)
    assert cupys_refusal in ([], None)


def test_with_the_routing_the_captured_gemms_replay_bitwise(cupys_refusal):
    graph = assert_graph_steps_are_the_eager_steps(small_config())
    assert graph.graph is not None
    assert cupys_refusal is None or "single" in cupys_refusal  # the capture's GEMMs went through the library
