"""The stand-in's libhipblas (ROCm only, BOOSTMPI_STANDIN_GPU=mi250x): what a ROCm node has beside CuPy.

CuPy does not bind hipBLAS's bfloat16 GEMMs; boostmpi.gpu.hipblas loads libhipblas with ctypes from
$ROCM_PATH/lib. Here that library is hipblas_standin.c, compiled once with the host's C compiler into
a directory that becomes ROCM_PATH for this process and its children (a stand-in machine has no other
ROCm). Its two functions, with hipblas.h's prototypes, call back into `_gemm` below, which applies
what hipBLAS and rocBLAS check and computes on the stand-in's device memory through the cuBLAS
stand-in's own machinery (cublas._gemm: the recorded GEMM, the stream-order accesses, shapes-only
mode), with the hipBLAS values translated to its cudaDataType / operation codes.

hipBLAS's values (ROCm/hipBLAS, library/include/hipblas.h at rocm-5.7.1, rocm-6.0.2, rocm-6.2.2):
hipblasOperation_t N = 111, T = 112, C = 113; hipblasDatatype_t R_16F = 150, R_32F = 151, R_64F = 152,
R_16B = 168; hipblasGemmAlgo_t HIPBLAS_GEMM_DEFAULT = 160; statuses INVALID_VALUE = 3,
NOT_SUPPORTED = 7, INVALID_ENUM = 10. rocBLAS's gemm_ex type table (rocm.docs.amd.com, rocblas_gemm_ex):
with f32 compute, bf16 A and B and a bf16 or f32 C/D; f16 likewise; f32 and f64 throughout.
"""

import ctypes
import hashlib
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

from cupy.cuda import runtime

OP = {111: 0, 112: 1, 113: 2}  # CUBLAS_OP_N, _T, _C (cublas.py imports this module: no import back at the top)
TYPES = {150: runtime.CUDA_R_16F, 151: runtime.CUDA_R_32F, 152: runtime.CUDA_R_64F, 168: runtime.CUDA_R_16BF}
R_16F, R_32F, R_64F, R_16B = 150, 151, 152, 168
GEMM_DEFAULT = 160
INVALID_VALUE, INTERNAL_ERROR, NOT_SUPPORTED, INVALID_ENUM = 3, 6, 7, 10
# rocBLAS's gemm_ex: computeType -> {(aType = bType, cType)}
SUPPORTED = {R_32F: {(R_16B, R_16B), (R_16B, R_32F), (R_16F, R_16F), (R_16F, R_32F), (R_32F, R_32F)},
             R_16F: {(R_16F, R_16F)}, R_64F: {(R_64F, R_64F)}}
SOURCE = Path(__file__).resolve().parents[2] / "hipblas" / "hipblas_standin.c"

_SIGNATURE = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int,
    ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int64,
    ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int)
calls = []  # (entry, aType, bType, cType, computeType, algo) of every call, for tests


def _gemm(handle, transa, transb, m, n, k, alpha, A, atype, lda, stride_a, B, btype, ldb, stride_b, beta, C, ctype,
          ldc, stride_c, count, compute, algo, strided):
    from cupy.cuda import cublas

    entry = "hipblasGemmStridedBatchedEx" if strided else "hipblasGemmEx"
    try:
        calls.append((entry, atype, btype, ctype, compute, algo))
        if transa not in OP or transb not in OP or algo != GEMM_DEFAULT or not {atype, btype, ctype, compute} <= set(TYPES):
            return INVALID_ENUM
        if compute not in SUPPORTED or atype != btype or (atype, ctype) not in SUPPORTED[compute]:
            return NOT_SUPPORTED
        cublas._gemm(handle or 0, OP[transa], OP[transb], m, n, k, alpha or 0, A or 0, TYPES[atype], lda, stride_a,
                     B or 0, TYPES[btype], ldb, stride_b, beta or 0, C or 0, TYPES[ctype], ldc, stride_c, count,
                     TYPES[compute], cublas.CUBLAS_GEMM_DEFAULT, entry, direct=True)
        return 0
    except cublas.CUBLASError as exc:
        return exc.status
    except BaseException:  # noqa: BLE001 - an exception cannot cross the C frame: say it, return a failure
        sys.stderr.write(f"hipBLAS stand-in, {entry}: {traceback.format_exc()}")
        return INTERNAL_ERROR


_callback = _SIGNATURE(_gemm)


def build():
    """The compiled library's directory (the stand-in's ROCM_PATH), built once per source text."""
    text = SOURCE.read_bytes()
    root = Path(tempfile.gettempdir()) / f"boostmpi-hipblas-standin-{hashlib.sha256(text).hexdigest()[:16]}"
    lib = root / "lib" / "libhipblas.so"
    if not lib.exists():
        lib.parent.mkdir(parents=True, exist_ok=True)
        partial = lib.with_name(f".libhipblas.{os.getpid()}.so")
        subprocess.run([os.environ.get("CC", "cc"), "-shared", "-fPIC", "-O1", "-o", str(partial), str(SOURCE)],
                       check=True, capture_output=True)
        os.replace(partial, lib)
    return root


def install():
    """Builds the library, makes its directory ROCM_PATH and registers the Python side."""
    root = build()
    os.environ["ROCM_PATH"] = str(root)
    ctypes.CDLL(str(root / "lib" / "libhipblas.so")).standin_register(_callback)
