"""The stand-in's libhipblas (ROCm only, BOOSTMPI_STANDIN_GPU=mi250x): what a ROCm node has beside CuPy.

CuPy does not bind hipBLAS's bfloat16 GEMMs; boostmpi.gpu.hipblas loads libhipblas with ctypes from
$ROCM_PATH/lib. Here that library is hipblas_standin.c, compiled once with the host's C compiler into
a directory that becomes ROCM_PATH for this process and its children (a stand-in machine has no other
ROCm), as one of hipBLAS's three releases' ABIs (BOOSTMPI_STANDIN_HIPBLAS: legacy = hipBLAS 1 of ROCm 5,
v2 = hipBLAS 2 of ROCm 6, v3 = hipBLAS 3 of ROCm 7, the default, as jobs/setup_frontier.sh loads),
with that release's soname (libhipblas.so.1, .2, .3). Its functions, with hipblas.h's prototypes, call
back into `_gemm` below, which applies what hipBLAS and rocBLAS check and computes on the stand-in's
device memory through the cuBLAS stand-in's own machinery (cublas._gemm: the recorded GEMM, the
stream-order accesses, shapes-only mode), with the values translated to cudaDataType / operation codes.

hipBLAS's values (ROCm/hipBLAS, library/include/hipblas.h at rocm-5.7.1, rocm-6.0.2, rocm-6.2.2):
hipblasOperation_t N = 111, T = 112, C = 113; hipblasDatatype_t R_16F = 150, R_32F = 151, R_64F = 152,
R_16B = 168; hipblasComputeType_t 16F = 0, 32F = 2, 64F = 7; HIP's hipDataType R_32F = 0, R_64F = 1,
R_16F = 2, R_16BF = 14; hipblasGemmAlgo_t HIPBLAS_GEMM_DEFAULT = 160; statuses NOT_SUPPORTED = 7,
INVALID_ENUM = 10. rocBLAS's gemm_ex type table (rocm.docs.amd.com, rocblas_gemm_ex): with float32
compute, bf16 A and B and a bf16 or f32 C/D; f16 likewise; f32 throughout; f64 with f64 compute.
"""

import collections
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
_16F, _32F, _64F, _16BF = runtime.CUDA_R_16F, runtime.CUDA_R_32F, runtime.CUDA_R_64F, runtime.CUDA_R_16BF
# per ABI (0 legacy, 1 the _v2 names, 2 hipBLAS 3): data type values, compute type values -> cudaDataType
TYPES = {0: {150: _16F, 151: _32F, 152: _64F, 168: _16BF}, 1: {2: _16F, 0: _32F, 1: _64F, 14: _16BF}}
COMPUTE = {0: {150: _16F, 151: _32F, 152: _64F}, 1: {0: _16F, 2: _32F, 7: _64F}}
TYPES[2], COMPUTE[2] = TYPES[1], COMPUTE[1]
ABIS = {"legacy": 0, "v2": 1, "v3": 2}
GEMM_DEFAULT = 160
INTERNAL_ERROR, NOT_SUPPORTED, INVALID_ENUM = 6, 7, 10
# rocBLAS's gemm_ex: compute type -> {(aType = bType, cType)}, in cudaDataType terms
SUPPORTED = {_32F: {(_16BF, _16BF), (_16BF, _32F), (_16F, _16F), (_16F, _32F), (_32F, _32F)},
             _16F: {(_16F, _16F)}, _64F: {(_64F, _64F)}}
SOURCE = Path(__file__).with_name("hipblas_standin.c")  # in the package: the emulated sites' stub wheel ships it

_SIGNATURE = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int,
    ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int64,
    ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int)
calls = collections.deque(maxlen=64)  # (entry, aType, bType, cType, computeType, algo) of the latest calls, for tests


def _gemm(handle, transa, transb, m, n, k, alpha, A, atype, lda, stride_a, B, btype, ldb, stride_b, beta, C, ctype,
          ldc, stride_c, count, compute, algo, strided, abi):
    from cupy.cuda import cublas

    entry = ("hipblasGemmStridedBatchedEx" if strided else "hipblasGemmEx") + ("_v2" if abi == 1 else "")
    try:
        calls.append((entry, atype, btype, ctype, compute, algo))
        types, computes = TYPES[abi], COMPUTE[abi]
        if (transa not in OP or transb not in OP or algo != GEMM_DEFAULT or not {atype, btype, ctype} <= set(types)
                or compute not in computes):
            return INVALID_ENUM
        a, b, c, work = types[atype], types[btype], types[ctype], computes[compute]
        if a != b or (a, c) not in SUPPORTED[work]:
            return NOT_SUPPORTED
        cublas._gemm(handle or 0, OP[transa], OP[transb], m, n, k, alpha or 0, A or 0, a, lda, stride_a, B or 0, b,
                     ldb, stride_b, beta or 0, C or 0, c, ldc, stride_c, count, work, cublas.CUBLAS_GEMM_DEFAULT, entry,
                     direct=True)
        return 0
    except cublas.CUBLASError as exc:
        return exc.status
    except BaseException:  # noqa: BLE001 - an exception cannot cross the C frame: say it, return a failure
        sys.stderr.write(f"hipBLAS stand-in, {entry}: {traceback.format_exc()}")
        return INTERNAL_ERROR


_callback = _SIGNATURE(_gemm)


def chosen_abi():
    name = os.environ.get("BOOSTMPI_STANDIN_HIPBLAS", "v3")
    if name not in ABIS:
        raise ValueError(f"BOOSTMPI_STANDIN_HIPBLAS={name!r}: expected one of {', '.join(ABIS)}")
    return name


def build(abi=None):
    """The compiled library's directory (the stand-in's ROCM_PATH) for an ABI (default: chosen_abi()),
    built once per source text: lib/libhipblas.so.N (N = the release's major version) and the
    libhipblas.so link to it, as ROCm installs them."""
    abi = abi or chosen_abi()
    text = SOURCE.read_bytes()
    root = Path(tempfile.gettempdir()) / f"boostmpi-hipblas-standin-{abi}-{hashlib.sha256(text).hexdigest()[:16]}"
    real = root / "lib" / f"libhipblas.so.{ABIS[abi] + 1}"
    link = root / "lib" / "libhipblas.so"
    if not link.exists():
        link.parent.mkdir(parents=True, exist_ok=True)
        partial = real.with_name(f".libhipblas.{os.getpid()}.so")
        subprocess.run([os.environ.get("CC", "cc"), "-shared", "-fPIC", "-O1", f"-DSTANDIN_ABI={ABIS[abi]}", "-o",
                        str(partial), str(SOURCE)], check=True, capture_output=True)
        os.replace(partial, real)
        temporary = link.with_name(f".libhipblas.so.{os.getpid()}")
        os.symlink(real.name, temporary)
        os.replace(temporary, link)
    return root


def install(abi=None):
    """Builds the library, makes its directory ROCM_PATH and registers the Python side."""
    root = build(abi)
    os.environ["ROCM_PATH"] = str(root)
    ctypes.CDLL(str(root / "lib" / "libhipblas.so")).standin_register(_callback)
