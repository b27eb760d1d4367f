"""hipBLAS's own GEMMs for bfloat16 on ROCm, through ctypes.

CuPy 14.2 reaches hipBLAS only through its shim of the cuBLAS API (cupy_backends/hip/cupy_hipblas.h at
v14.2.0), which has no bfloat16 type: it ends the process on CUDA_R_16BF (boostmpi/gpu/blas.py says
where). hipBLAS itself multiplies bfloat16 with float32 accumulation on the MI250X's matrix cores:
`hipblasGemmEx` and `hipblasGemmStridedBatchedEx` with bfloat16 operands, a bfloat16 or float32
output and float32 compute (rocBLAS's gemm_ex table lists both pairs). So
`boostmpi.gpu.blas` calls these two functions of libhipblas directly for bfloat16 products on ROCm,
on the handle CuPy made (a hipblasHandle_t on ROCm) and CuPy's current stream.

hipBLAS has had three ABIs for these two functions, with the same arguments in the same places and
widths (tests/hipblas_checked.txt records the header lines; tests/unit/gpu/test_hipblas.py compares the
declarations below with them):
- "legacy" (hipBLAS 0.x-1.x of ROCm 5, and still exported by 2.x): `hipblasGemmEx` and
  `hipblasGemmStridedBatchedEx` with hipblasDatatype_t types (HIPBLAS_R_16B = 168, HIPBLAS_R_32F =
  151) and a hipblasDatatype_t compute type (HIPBLAS_R_32F);
- "v2" (hipBLAS 2.x of ROCm 6): `hipblasGemmEx_v2` and `hipblasGemmStridedBatchedEx_v2` with HIP's
  hipDataType (HIP_R_16BF = 14, HIP_R_32F = 0) and hipblasComputeType_t (HIPBLAS_COMPUTE_32F = 2);
- "v3" (hipBLAS 3 of ROCm 7): the v2 signature under the plain names, the only API left
  (hipBLAS 3.0.0's changelog: hipblasDatatype_t removed, "HIPBLAS_V2 API is now the only available
  API"; ROCm/hipBLAS pull request 982).
A library exporting the `_v2` names is "v2"; otherwise its soname's major version (libhipblas.so.3)
tells "v3" from "legacy". The centres' setup (jobs/setup_frontier.sh) loads ROCm 7.

libhipblas is found as ROCm installs it: $ROCM_PATH/lib (ROCm's own variable, which `module load rocm`
sets on the centres' machines), then the loader's search path. Without it a bfloat16 product falls
back to float32 copies (what blas.py did before), saying so once on standard error.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import re
import sys
from collections.abc import Callable
from typing import TypedDict

# hipblas.h: hipblasOperation_t, hipblasGemmAlgo_t, hipblasStatus_t
HIPBLAS_OP_N, HIPBLAS_OP_T = 111, 112
HIPBLAS_GEMM_DEFAULT = 160
STATUS = {0: "HIPBLAS_STATUS_SUCCESS", 1: "HIPBLAS_STATUS_NOT_INITIALIZED", 2: "HIPBLAS_STATUS_ALLOC_FAILED",
          3: "HIPBLAS_STATUS_INVALID_VALUE", 4: "HIPBLAS_STATUS_MAPPING_ERROR", 5: "HIPBLAS_STATUS_EXECUTION_FAILED",
          6: "HIPBLAS_STATUS_INTERNAL_ERROR", 7: "HIPBLAS_STATUS_NOT_SUPPORTED", 8: "HIPBLAS_STATUS_ARCH_MISMATCH",
          9: "HIPBLAS_STATUS_HANDLE_IS_NULLPTR", 10: "HIPBLAS_STATUS_INVALID_ENUM", 11: "HIPBLAS_STATUS_UNKNOWN"}
class _Abi(TypedDict):
    names: tuple[str, str]
    bf16: int
    f32: int
    compute: int


# per ABI: the two functions' names, the bfloat16 and float32 type values, the float32 compute type
ABIS: dict[str, _Abi] = {
    "legacy": {"names": ("hipblasGemmEx", "hipblasGemmStridedBatchedEx"), "bf16": 168, "f32": 151, "compute": 151},
    "v2": {"names": ("hipblasGemmEx_v2", "hipblasGemmStridedBatchedEx_v2"), "bf16": 14, "f32": 0, "compute": 2},
    "v3": {"names": ("hipblasGemmEx", "hipblasGemmStridedBatchedEx"), "bf16": 14, "f32": 0, "compute": 2},
}

_c = ctypes
# the C prototypes, argument by argument, the same in every ABI (enums are C ints, hipblasStride int64_t)
PROTOTYPES = {
    "gemm": (
        _c.c_void_p, _c.c_int, _c.c_int, _c.c_int, _c.c_int, _c.c_int,  # handle, transA, transB, m, n, k
        _c.c_void_p, _c.c_void_p, _c.c_int, _c.c_int,  # alpha, A, aType, lda
        _c.c_void_p, _c.c_int, _c.c_int,  # B, bType, ldb
        _c.c_void_p, _c.c_void_p, _c.c_int, _c.c_int,  # beta, C, cType, ldc
        _c.c_int, _c.c_int),  # computeType, algo
    "strided": (
        _c.c_void_p, _c.c_int, _c.c_int, _c.c_int, _c.c_int, _c.c_int,  # handle, transA, transB, m, n, k
        _c.c_void_p, _c.c_void_p, _c.c_int, _c.c_int, _c.c_int64,  # alpha, A, aType, lda, strideA
        _c.c_void_p, _c.c_int, _c.c_int, _c.c_int64,  # B, bType, ldb, strideB
        _c.c_void_p, _c.c_void_p, _c.c_int, _c.c_int, _c.c_int64,  # beta, C, cType, ldc, strideC
        _c.c_int, _c.c_int, _c.c_int),  # batchCount, computeType, algo
}
LIBRARY_NAMES = ("libhipblas.so", "libhipblas.so.3", "libhipblas.so.2", "libhipblas.so.1", "libhipblas.so.0")


class HipblasError(RuntimeError):
    pass


def library_path() -> str | None:
    """Where libhipblas is: $ROCM_PATH/lib first, then the dynamic loader's own search (None: nowhere)."""
    root = os.environ.get("ROCM_PATH")
    if root:
        for name in LIBRARY_NAMES:
            path = os.path.join(root, "lib", name)
            if os.path.exists(path):
                return path
    return ctypes.util.find_library("hipblas")


def abi_of(lib: ctypes.CDLL, path: str) -> str:
    """Which of ABIS a loaded libhipblas speaks (see the module docstring)."""
    if hasattr(lib, ABIS["v2"]["names"][0]):
        return "v2"
    major = re.search(r"\.so\.(\d+)", os.path.basename(os.path.realpath(path)))
    return "v3" if major and int(major.group(1)) >= 3 else "legacy"


@functools.lru_cache(maxsize=None)
def library() -> tuple[ctypes.CDLL, str, tuple[Callable[..., int], ...]] | None:
    """(libhipblas, its ABI, its two GEMMs declared) or None when it is not installed."""
    path = library_path()
    if path is None:
        return None
    lib = ctypes.CDLL(path)
    abi = abi_of(lib, path)
    functions = []
    for name, argtypes in zip(ABIS[abi]["names"], PROTOTYPES.values()):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, ctypes.c_int
        functions.append(fn)
    return lib, abi, tuple(functions)


@functools.lru_cache(maxsize=None)
def say_missing() -> None:
    print("boostmpi: bfloat16 products on ROCm run on float32 copies: libhipblas was not found "
          "(looked in $ROCM_PATH/lib and the loader's path)", file=sys.stderr, flush=True)


def gemm(handle: int, transa: int, transb: int, m: int, n: int, k: int, alpha: int, A: int, lda: int, stride_a: int,
         B: int, ldb: int, stride_b: int, beta: int, C: int, c_float32: bool, ldc: int, stride_c: int, count: int,
         ) -> None:
    """One column-major GEMM of bfloat16 A and B (count == 1: GemmEx) or a strided batch, float32
    compute, C bfloat16 or (c_float32) float32; the operation codes are hipBLAS's (HIPBLAS_OP_N / _T),
    alpha and beta host addresses of floats. Raises HipblasError with hipBLAS's status name."""
    found = library()
    assert found is not None  # called only where libhipblas is loaded
    _, abi, (single, strided) = found
    values = ABIS[abi]
    bf16, ctype = values["bf16"], values["f32"] if c_float32 else values["bf16"]
    if count == 1:
        status = single(handle, transa, transb, m, n, k, alpha, A, bf16, lda, B, bf16, ldb, beta, C, ctype, ldc,
                        values["compute"], HIPBLAS_GEMM_DEFAULT)
    else:
        status = strided(handle, transa, transb, m, n, k, alpha, A, bf16, lda, stride_a, B, bf16, ldb, stride_b, beta,
                         C, ctype, ldc, stride_c, count, values["compute"], HIPBLAS_GEMM_DEFAULT)
    if status != 0:
        name = values["names"][count != 1]
        raise HipblasError(f"{name} returned {STATUS.get(status, status)} (m={m}, n={n}, k={k}, batch {count})")
