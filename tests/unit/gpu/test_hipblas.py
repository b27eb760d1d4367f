"""boostmpi.gpu.hipblas: the ctypes declarations of hipBLAS's two GEMMs, their names and enumeration
values in each of hipBLAS's three ABIs (ROCm 5, 6, 7) against what the headers say
(tests/hipblas_checked.txt records it), which ABI a library is taken for, and a real C call through the
declarations into the stand-in's libhipblas (testing/cupy_standin/cupy/cuda/hipblas_standin.c) built as each release.
Mutants: a declaration of the wrong width fails the comparison; the enumeration values of another ABI
fail the call."""

import ctypes
from pathlib import Path

import numpy as np
import pytest

from boostmpi.gpu import hipblas
from tests.support.gpu_setup import GPU

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not GPU.standin, reason="calls the stand-in's libhipblas; a real GPU is in use")]

CHECKED = Path(__file__).resolve().parents[2] / "hipblas_checked.txt"
C_TYPES = {"hipblasHandle_t": ctypes.c_void_p, "void*": ctypes.c_void_p, "int": ctypes.c_int,
           "hipblasOperation_t": ctypes.c_int, "hipblasDatatype_t": ctypes.c_int, "hipDataType": ctypes.c_int,
           "hipblasComputeType_t": ctypes.c_int, "hipblasGemmAlgo_t": ctypes.c_int, "hipblasStride": ctypes.c_int64}
ABIS = ("legacy", "v2", "v3")


def recorded():
    prototypes, values, names = {}, {}, {}
    for line in CHECKED.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        words = line.split()
        if words[0] == "prototype":
            head, params = line.split(":", 1)
            _, abi, role = head.split()
            prototypes[abi, role] = tuple(C_TYPES[p.strip()] for p in params.split(","))
        elif words[0] == "value":
            values[tuple(words[1:-1])] = int(words[-1])
        elif words[0] == "names":
            names[words[1]] = tuple(words[2:])
    return prototypes, values, names


def check_declarations(module=hipblas):
    prototypes, values, names = recorded()
    for (abi, role), argtypes in prototypes.items():
        assert module.PROTOTYPES[role] == argtypes, (abi, role)
    for key, number in values.items():
        got = getattr(module, key[0]) if len(key) == 1 else module.ABIS[key[0]][key[1]]
        assert got == number, key
    for abi in ABIS:
        assert module.ABIS[abi]["names"] == names[abi], abi


def test_declarations_are_the_headers():
    check_declarations()


def test_a_declaration_of_the_wrong_width_fails_the_check(monkeypatch):
    args = list(hipblas.PROTOTYPES["strided"])
    args[10] = ctypes.c_int  # strideA as a 32-bit int, where hipblasStride is int64_t
    monkeypatch.setitem(hipblas.PROTOTYPES, "strided", tuple(args))
    with pytest.raises(AssertionError):
        check_declarations()


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
    hipblas.gemm(handle, hipblas.HIPBLAS_OP_N, hipblas.HIPBLAS_OP_N, 6, 5, 4, one.ctypes.data, db.data.ptr, 6, 24,
                 da.data.ptr, 4, 20, zero.ctypes.data, dc.data.ptr, False, 6, 30, 3)
    return dc.get(), np.matmul(a.astype(np.float32), b.astype(np.float32)).astype(bf16)


@pytest.fixture(params=ABIS)
def library(request, monkeypatch):
    """The stand-in's libhipblas built as one release, on $ROCM_PATH, loaded afresh by boostmpi.gpu.hipblas."""
    from tests.support.gpu_setup import use_hipblas_standin

    monkeypatch.setenv("BOOSTMPI_STANDIN_HIPBLAS", request.param)
    yield request.param, use_hipblas_standin(monkeypatch)
    hipblas.library.cache_clear()


def test_a_real_c_call_through_the_declarations_computes_the_product(library):
    import cupy

    abi, standin = library
    assert hipblas.library()[1] == abi  # the ABI told from the symbols and the soname
    got, want = _batched_product(cupy)
    np.testing.assert_array_equal(got, want)
    bf16, compute = hipblas.ABIS[abi]["bf16"], hipblas.ABIS[abi]["compute"]
    assert standin.calls[-1] == (hipblas.ABIS[abi]["names"][1], bf16, bf16, bf16, compute, 160)


def test_a_wrong_enumeration_fails_the_call(library, monkeypatch):
    """Mutant: the bfloat16 value of the other kind of ABI (168, hipblasDatatype_t's, where hipDataType is
    spoken; 14, hipDataType's, where hipblasDatatype_t is), as a library taken for the wrong release would
    pass it: hipBLAS refuses the value or finds no such product."""
    import cupy

    abi, _ = library
    other = "legacy" if abi != "legacy" else "v3"
    wrong = {name: dict(values) for name, values in hipblas.ABIS.items()}
    wrong[abi]["bf16"] = hipblas.ABIS[other]["bf16"]
    monkeypatch.setattr(hipblas, "ABIS", wrong)
    with pytest.raises(hipblas.HipblasError, match="HIPBLAS_STATUS_INVALID_ENUM|HIPBLAS_STATUS_NOT_SUPPORTED"):
        _batched_product(cupy)


def test_without_the_library_there_is_none(monkeypatch, tmp_path):
    monkeypatch.setenv("ROCM_PATH", str(tmp_path))
    monkeypatch.setattr(hipblas.ctypes.util, "find_library", lambda name: None)
    hipblas.library.cache_clear()
    try:
        assert hipblas.library_path() is None and hipblas.library() is None
    finally:
        hipblas.library.cache_clear()
