"""boostmpi.gpu.hipblas: the ctypes declarations of hipBLAS's two GEMMs and its enumeration values
against what hipblas.h says at ROCm 5.7, 6.0 and 6.2 (tests/hipblas_checked.txt records it), and a
real C call through them into the stand-in's libhipblas (tests/cupy_standin/hipblas/); mutants: a
declaration of the wrong width fails the comparison, a wrong enumeration value fails the call."""

import ctypes
from pathlib import Path

import numpy as np
import pytest

from boostmpi.gpu import hipblas
from gpu_setup import GPU

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not GPU.standin, reason="calls the stand-in's libhipblas; a real GPU is in use")]

CHECKED = Path(__file__).with_name("hipblas_checked.txt")
C_TYPES = {"hipblasHandle_t": ctypes.c_void_p, "void*": ctypes.c_void_p, "int": ctypes.c_int,
           "hipblasOperation_t": ctypes.c_int, "hipblasDatatype_t": ctypes.c_int, "hipblasGemmAlgo_t": ctypes.c_int,
           "hipblasStride": ctypes.c_int64}


def recorded():
    prototypes, values = {}, {}
    for line in CHECKED.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        if line.startswith("value "):
            _, name, number = line.split()
            values[name] = int(number)
        else:
            name, params = line.split(":", 1)
            prototypes[name] = tuple(C_TYPES[p.strip()] for p in params.split(","))
    return prototypes, values


def check_declarations(module=hipblas):
    prototypes, values = recorded()
    assert set(prototypes) == set(module.PROTOTYPES)
    for name, argtypes in prototypes.items():
        assert module.PROTOTYPES[name] == argtypes, name
    for name, number in values.items():
        assert getattr(module, name) == number, name


def test_declarations_are_hipblas_h():
    check_declarations()


def test_a_declaration_of_the_wrong_width_fails_the_check(monkeypatch):
    wrong = dict(hipblas.PROTOTYPES)
    args = list(wrong["hipblasGemmStridedBatchedEx"])
    args[10] = ctypes.c_int  # strideA as a 32-bit int, where hipblasStride is int64_t
    wrong["hipblasGemmStridedBatchedEx"] = tuple(args)
    monkeypatch.setattr(hipblas, "PROTOTYPES", wrong)
    with pytest.raises(AssertionError):
        check_declarations()


@pytest.fixture
def library(monkeypatch):
    """The stand-in's libhipblas on $ROCM_PATH, loaded afresh through boostmpi.gpu.hipblas."""
    from gpu_setup import use_hipblas_standin

    yield use_hipblas_standin(monkeypatch)
    hipblas.library.cache_clear()


def _batched_product(cupy):
    """A strided batch of bfloat16 products through hipblas.gemm: (result, the float32 product rounded once)."""
    import ml_dtypes

    from cupy.cuda import cublas

    bf16 = np.dtype(ml_dtypes.bfloat16)
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((3, 5, 4)).astype(bf16), rng.standard_normal((3, 4, 6)).astype(bf16)
    da, db, dc = cupy.asarray(a), cupy.asarray(b), cupy.empty((3, 5, 6), bf16)
    one, zero = np.ones(1, np.float32), np.zeros(1, np.float32)
    handle = cupy.cuda.get_cublas_handle()
    cublas.setStream(handle, cupy.cuda.get_current_stream().ptr)
    # row-major C = A B is column-major C^T = B^T A^T: (n, m, k) = (6, 5, 4)
    hipblas.gemm(handle, hipblas.HIPBLAS_OP_N, hipblas.HIPBLAS_OP_N, 6, 5, 4, one.ctypes.data, db.data.ptr,
                 hipblas.HIPBLAS_R_16B, 6, 24, da.data.ptr, hipblas.HIPBLAS_R_16B, 4, 20, zero.ctypes.data, dc.data.ptr,
                 hipblas.HIPBLAS_R_16B, 6, 30, 3)
    return dc.get(), np.matmul(a.astype(np.float32), b.astype(np.float32)).astype(bf16)


def test_a_real_c_call_through_the_declarations_computes_the_product(library):
    import cupy

    got, want = _batched_product(cupy)
    np.testing.assert_array_equal(got, want)
    assert library.calls[-1] == ("hipblasGemmStridedBatchedEx", 168, 168, 168, 151, 160)


def test_a_wrong_enumeration_fails_the_call(library, monkeypatch):
    """Mutants: HIPBLAS_R_16B given as HIPBLAS_R_16F's 150 makes hipBLAS read the bfloat16 operands as
    half floats (a product of other numbers); given as an unknown 167, the call is refused. (A declaration
    of the wrong width is the check above: on x86-64 a 32-bit int in a 64-bit slot still arrives whole
    for small values, so only the comparison with the header catches it.)"""
    import cupy

    monkeypatch.setattr(hipblas, "HIPBLAS_R_16B", 150)
    got, want = _batched_product(cupy)
    assert not np.array_equal(got, want)
    monkeypatch.setattr(hipblas, "HIPBLAS_R_16B", 167)
    with pytest.raises(hipblas.HipblasError, match="HIPBLAS_STATUS_INVALID_ENUM"):
        _batched_product(cupy)


def test_without_the_library_there_is_none(monkeypatch, tmp_path):
    monkeypatch.setenv("ROCM_PATH", str(tmp_path))
    monkeypatch.setattr(hipblas.ctypes.util, "find_library", lambda name: None)
    hipblas.library.cache_clear()
    try:
        assert hipblas.library_path() is None and hipblas.library() is None
    finally:
        hipblas.library.cache_clear()
