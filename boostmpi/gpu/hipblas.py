"""hipBLAS's own GEMMs for bfloat16 on ROCm, through ctypes.

CuPy 14.2 reaches hipBLAS only through its shim of the cuBLAS API (cupy_backends/hip/cupy_hipblas.h at
v14.2.0), which has no bfloat16 type: it ends the process on CUDA_R_16BF (boostmpi/gpu/blas.py says
where). hipBLAS itself multiplies bfloat16 with float32 accumulation on the MI250X's matrix cores:
`hipblasGemmEx` and `hipblasGemmStridedBatchedEx` with HIPBLAS_R_16B operands, a HIPBLAS_R_16B or
HIPBLAS_R_32F output and HIPBLAS_R_32F compute (rocBLAS's gemm_ex table lists both pairs). So
`boostmpi.gpu.blas` calls these two functions of libhipblas directly for bfloat16 products on ROCm,
on the handle CuPy made (a hipblasHandle_t on ROCm) and CuPy's current stream.

The prototypes and enumeration values are hipblas.h's (ROCm/hipBLAS, library/include/hipblas.h at the
tags rocm-5.7.1, rocm-6.0.2 and rocm-6.2.2 and on its main branch): the exported `hipblasGemmEx` and
`hipblasGemmStridedBatchedEx` take hipblasDatatype_t types and a hipblasDatatype_t compute type in
every one of them (ROCm 6 adds `..._v2` entry points with hipDataType, which a program reaches by
compiling with -DHIPBLAS_V2; the exported legacy symbols stay). tests/hipblas_checked.txt records
the lines, and tests/test_hipblas.py compares this module's declarations with them.

libhipblas is found as ROCm installs it: $ROCM_PATH/lib (ROCm's own variable, which `module load rocm`
sets on the centres' machines), then the loader's search path. Without it a bfloat16 product falls
back to float32 copies (what blas.py did before), saying so once on standard error.
"""

import ctypes
import ctypes.util
import functools
import os
import sys

# hipblas.h: hipblasOperation_t, hipblasDatatype_t, hipblasGemmAlgo_t, hipblasStatus_t
HIPBLAS_OP_N, HIPBLAS_OP_T = 111, 112
HIPBLAS_R_32F, HIPBLAS_R_16B = 151, 168
HIPBLAS_GEMM_DEFAULT = 160
STATUS = {0: "HIPBLAS_STATUS_SUCCESS", 1: "HIPBLAS_STATUS_NOT_INITIALIZED", 2: "HIPBLAS_STATUS_ALLOC_FAILED",
          3: "HIPBLAS_STATUS_INVALID_VALUE", 4: "HIPBLAS_STATUS_MAPPING_ERROR", 5: "HIPBLAS_STATUS_EXECUTION_FAILED",
          6: "HIPBLAS_STATUS_INTERNAL_ERROR", 7: "HIPBLAS_STATUS_NOT_SUPPORTED", 8: "HIPBLAS_STATUS_ARCH_MISMATCH",
          9: "HIPBLAS_STATUS_HANDLE_IS_NULLPTR", 10: "HIPBLAS_STATUS_INVALID_ENUM", 11: "HIPBLAS_STATUS_UNKNOWN"}

_c = ctypes
# (name, argument types): the C prototypes, argument by argument (enums are C ints, hipblasStride int64_t)
PROTOTYPES = {
    "hipblasGemmEx": (
        _c.c_void_p, _c.c_int, _c.c_int, _c.c_int, _c.c_int, _c.c_int,  # handle, transA, transB, m, n, k
        _c.c_void_p, _c.c_void_p, _c.c_int, _c.c_int,  # alpha, A, aType, lda
        _c.c_void_p, _c.c_int, _c.c_int,  # B, bType, ldb
        _c.c_void_p, _c.c_void_p, _c.c_int, _c.c_int,  # beta, C, cType, ldc
        _c.c_int, _c.c_int),  # computeType, algo
    "hipblasGemmStridedBatchedEx": (
        _c.c_void_p, _c.c_int, _c.c_int, _c.c_int, _c.c_int, _c.c_int,  # handle, transA, transB, m, n, k
        _c.c_void_p, _c.c_void_p, _c.c_int, _c.c_int, _c.c_int64,  # alpha, A, aType, lda, strideA
        _c.c_void_p, _c.c_int, _c.c_int, _c.c_int64,  # B, bType, ldb, strideB
        _c.c_void_p, _c.c_void_p, _c.c_int, _c.c_int, _c.c_int64,  # beta, C, cType, ldc, strideC
        _c.c_int, _c.c_int, _c.c_int),  # batchCount, computeType, algo
}
LIBRARY_NAMES = ("libhipblas.so", "libhipblas.so.2", "libhipblas.so.1", "libhipblas.so.0")


class HipblasError(RuntimeError):
    pass


def library_path():
    """Where libhipblas is: $ROCM_PATH/lib first, then the dynamic loader's own search (None: nowhere)."""
    root = os.environ.get("ROCM_PATH")
    if root:
        for name in LIBRARY_NAMES:
            path = os.path.join(root, "lib", name)
            if os.path.exists(path):
                return path
    return ctypes.util.find_library("hipblas")


@functools.lru_cache(maxsize=None)
def library():
    """libhipblas with the two GEMMs declared, or None when it is not installed."""
    path = library_path()
    if path is None:
        return None
    lib = ctypes.CDLL(path)
    for name, argtypes in PROTOTYPES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return lib


@functools.lru_cache(maxsize=None)
def say_missing():
    print("boostmpi: bfloat16 products on ROCm run on float32 copies: libhipblas was not found "
          "(looked in $ROCM_PATH/lib and the loader's path)", file=sys.stderr, flush=True)


def gemm(handle, transa, transb, m, n, k, alpha, A, atype, lda, stride_a, B, btype, ldb, stride_b, beta, C, ctype,
         ldc, stride_c, count):
    """One column-major GEMM (count == 1: hipblasGemmEx) or a strided batch, float32 compute; the
    operation codes are hipBLAS's (HIPBLAS_OP_N / _T), the types hipblasDatatype_t, alpha and beta
    host addresses of floats. Raises HipblasError with hipBLAS's status name."""
    lib = library()
    if count == 1:
        status = lib.hipblasGemmEx(handle, transa, transb, m, n, k, alpha, A, atype, lda, B, btype, ldb, beta, C,
                                   ctype, ldc, HIPBLAS_R_32F, HIPBLAS_GEMM_DEFAULT)
        name = "hipblasGemmEx"
    else:
        status = lib.hipblasGemmStridedBatchedEx(handle, transa, transb, m, n, k, alpha, A, atype, lda, stride_a, B,
                                                 btype, ldb, stride_b, beta, C, ctype, ldc, stride_c, count,
                                                 HIPBLAS_R_32F, HIPBLAS_GEMM_DEFAULT)
        name = "hipblasGemmStridedBatchedEx"
    if status != 0:
        raise HipblasError(f"{name} returned {STATUS.get(status, status)} (m={m}, n={n}, k={k}, batch {count})")
