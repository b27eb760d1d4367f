"""`cupy.cuda.cublas` of the stand-in: the cuBLAS bindings the project calls, with their checks.

The signatures are those of CuPy 14.2.0's binding (cupy_backends/cuda/libs/cublas.pyx at tag
v14.2.0: `gemmEx` line 1639, `gemmStridedBatchedEx` line 1682, `setStream` line 642): every
argument is converted as Cython converts it (C `int`: an integer that fits 32 bits, `size_t`: a
non-negative integer, `long long` strides), so a float, a NumPy array or an out-of-range value
raises where the real binding raises. Then what cuBLAS itself checks (the cuBLAS library guide,
https://docs.nvidia.com/cuda/cublas/index.html#cublasgemmex, "cublasGemmEx" and its table of
supported Atype/Btype/Ctype per computeType, which `cublasGemmStridedBatchedEx` shares) comes back
as `CUBLASError` with cuBLAS's status. The product is computed by NumPy in the compute type
(float32 for CUBLAS_COMPUTE_32F, float64 for CUBLAS_COMPUTE_64F) from the device memory the
pointers address, and rounded once to Ctype.

On ROCm (BOOSTMPI_STANDIN_GPU=mi250x) CuPy 14.2 routes these calls through its hipBLAS shim
(cupy_backends/hip/cupy_hipblas.h at v14.2.0), which the stand-in follows:
- a cuBLAS compute type (>= CUBLAS_COMPUTE_16F) takes the `_v11` entry, which returns
  HIPBLAS_STATUS_NOT_SUPPORTED (lines 565-570): on ROCm the compute type must be the legacy
  cudaDataType (CUDA_R_32F = 0 for float compute), which `convert_hipblasComputeType_t` maps to
  HIPBLAS_COMPUTE_32F (lines 76-93);
- an algorithm other than CUBLAS_GEMM_DEFAULT (-1) returns HIPBLAS_STATUS_NOT_SUPPORTED (line 403);
- `convert_hipblasDatatype_t` (lines 57-72) knows the cudaDataType values 0-9 only: CUDA_R_16BF
  (14) throws std::runtime_error("unrecognized type") out of an `extern "C"` function the binding
  does not declare `except +`, which ends the process (std::terminate). CuPy's own bfloat16 matmul
  test is skipped on ROCm for that reason (tests/cupy_tests/core_tests/test_bfloat16.py line 170,
  "Matrix version crashed CI."). The stand-in raises `ProcessAbort` there.
"""

import ctypes
import itertools

import numpy as np

from cupy.cuda import runtime

# cupy_backends/cuda/libs/cublas.pxd at v14.2.0, lines 44-82
CUBLAS_OP_N, CUBLAS_OP_T, CUBLAS_OP_C = 0, 1, 2
CUBLAS_POINTER_MODE_HOST, CUBLAS_POINTER_MODE_DEVICE = 0, 1
CUBLAS_GEMM_DEFAULT = -1
CUBLAS_GEMM_DEFAULT_TENSOR_OP = 99
CUBLAS_DEFAULT_MATH, CUBLAS_TENSOR_OP_MATH = 0, 1
CUBLAS_COMPUTE_16F, CUBLAS_COMPUTE_16F_PEDANTIC = 64, 65
CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_32F_PEDANTIC = 68, 69
CUBLAS_COMPUTE_32F_FAST_16F, CUBLAS_COMPUTE_32F_FAST_16BF, CUBLAS_COMPUTE_32F_FAST_TF32 = 74, 75, 77
CUBLAS_COMPUTE_64F, CUBLAS_COMPUTE_64F_PEDANTIC = 70, 71
CUBLAS_COMPUTE_32I, CUBLAS_COMPUTE_32I_PEDANTIC = 72, 73

# cuBLAS statuses (cupy_backends/cuda/libs/cublas.pyx at v14.2.0, lines 549-573)
_STATUS = {1: "CUBLAS_STATUS_NOT_INITIALIZED", 7: "CUBLAS_STATUS_INVALID_VALUE",
           8: "CUBLAS_STATUS_ARCH_MISMATCH", 15: "CUBLAS_STATUS_NOT_SUPPORTED"}
_HIP_STATUS = {1: "HIPBLAS_STATUS_NOT_INITIALIZED", 3: "HIPBLAS_STATUS_INVALID_VALUE",
               7: "HIPBLAS_STATUS_NOT_SUPPORTED"}
_CODES = {False: {v: k for k, v in _STATUS.items()}, True: {v: k for k, v in _HIP_STATUS.items()}}


class CUBLASError(RuntimeError):
    def __init__(self, status):
        self.status = status
        super().__init__((_HIP_STATUS if runtime.is_hip else _STATUS)[status])


def _error(name):
    """CUBLASError for a status named as cuBLAS names it, with the number cuBLAS or hipBLAS uses."""
    hip = bool(runtime.is_hip)
    return CUBLASError(_CODES[hip][name.replace("CUBLAS_", "HIPBLAS_") if hip else name])


class ProcessAbort(RuntimeError):
    """What ends the whole process on a real device (a C++ exception through CuPy's C shim)."""


# the cuBLAS guide's type table for cublasGemmEx / cublasGemmStridedBatchedEx:
# compute type -> {(Atype = Btype, Ctype)}; the scale type (alpha, beta) follows the compute type
_R16F, _R32F, _R64F, _C32F, _C64F, _R8I, _R16BF, _R32I, _C8I = (
    runtime.CUDA_R_16F, runtime.CUDA_R_32F, runtime.CUDA_R_64F, runtime.CUDA_C_32F, runtime.CUDA_C_64F,
    runtime.CUDA_R_8I, runtime.CUDA_R_16BF, runtime.CUDA_R_32I, runtime.CUDA_C_8I)
_F32_PAIRS = {(_R16BF, _R16BF), (_R16F, _R16F), (_R8I, _R32F), (_R16BF, _R32F), (_R16F, _R32F), (_R32F, _R32F),
              (_C8I, _C32F), (_C32F, _C32F)}
_SUPPORTED = {
    CUBLAS_COMPUTE_16F: {(_R16F, _R16F)}, CUBLAS_COMPUTE_16F_PEDANTIC: {(_R16F, _R16F)},
    CUBLAS_COMPUTE_32F: _F32_PAIRS, CUBLAS_COMPUTE_32F_PEDANTIC: _F32_PAIRS,
    CUBLAS_COMPUTE_32F_FAST_16F: {(_R32F, _R32F), (_C32F, _C32F)},
    CUBLAS_COMPUTE_32F_FAST_16BF: {(_R32F, _R32F), (_C32F, _C32F)},
    CUBLAS_COMPUTE_32F_FAST_TF32: {(_R32F, _R32F), (_C32F, _C32F)},
    CUBLAS_COMPUTE_64F: {(_R64F, _R64F), (_C64F, _C64F)}, CUBLAS_COMPUTE_64F_PEDANTIC: {(_R64F, _R64F), (_C64F, _C64F)},
    CUBLAS_COMPUTE_32I: {(_R8I, _R32I)}, CUBLAS_COMPUTE_32I_PEDANTIC: {(_R8I, _R32I)},
}
# a cudaDataType given as the compute type (the binding's non-_v11 branch; cuBLAS keeps these
# for compatibility, and CuPy's own batched matmul passes them: _routines_linalg.pyx line 1014)
_LEGACY_COMPUTE = {_R16F: CUBLAS_COMPUTE_16F, _R32F: CUBLAS_COMPUTE_32F, _R64F: CUBLAS_COMPUTE_64F,
                   _C32F: CUBLAS_COMPUTE_32F, _C64F: CUBLAS_COMPUTE_64F, _R32I: CUBLAS_COMPUTE_32I}


def _storage_dtype(cuda_type):
    if cuda_type == _R16BF:
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype({_R16F: np.float16, _R32F: np.float32, _R64F: np.float64, _C32F: np.complex64,
                     _C64F: np.complex128, _R8I: np.int8, _R32I: np.int32}[cuda_type])


def _cuda_type(dtype):
    """The cudaDataType of a float or complex NumPy dtype."""
    dtype = np.dtype(dtype)
    if dtype.name == "bfloat16":
        return _R16BF
    return {"e": _R16F, "f": _R32F, "d": _R64F, "F": _C32F, "D": _C64F}[dtype.char]


def called(api, batch, m, n, k, Atype, Btype, Ctype, computeType, beta_zero=True):
    """Every GEMM cuBLAS runs passes here once: the binding's calls (m, n, k as given, column-major),
    and the batched ones CuPy's own `matmul` makes (cupy/__init__.py `_cublas_call`). `beta_zero`:
    C is only written (False: accumulated into, so read as well). A no-op that traces wrap
    (bench/gpu_trace.py) to learn each GEMM's shape, data types and compute type."""


def compute_type(computeType):
    """A cuBLAS compute type, with a legacy cudaDataType given as compute type mapped to its own."""
    return _LEGACY_COMPUTE.get(computeType, computeType)


def tensor_core_bf16(Atype, Btype, Ctype, computeType):
    """Whether a GEMM runs bfloat16 inputs with float32 accumulation, which cuBLAS does on tensor cores
    (sm_80 and later): A = B = CUDA_R_16BF, compute type CUBLAS_COMPUTE_32F (or the legacy CUDA_R_32F),
    and (Atype, Ctype) a row of the guide's table for that compute type. CUBLAS_COMPUTE_32F_PEDANTIC
    (no reduced-precision or alternative algorithms) is not counted."""
    compute = compute_type(computeType)
    return (Atype == Btype == _R16BF and compute == CUBLAS_COMPUTE_32F
            and (Atype, Ctype) in _SUPPORTED[CUBLAS_COMPUTE_32F])


# ------------------------------------------------------------------ Cython argument conversion
def _c_int(name, v, bits=32):
    if isinstance(v, (bool, np.bool_)) or not hasattr(v, "__index__"):
        raise TypeError(f"an integer is required (argument {name!r} got {type(v).__name__})")
    v = v.__index__()
    if not -(2 ** (bits - 1)) <= v < 2 ** (bits - 1):
        raise OverflowError(f"value too large to convert to {'int' if bits == 32 else 'long long'} ({name}={v})")
    return v


def _size_t(name, v):
    if isinstance(v, (bool, np.bool_)) or not hasattr(v, "__index__"):
        raise TypeError(f"an integer is required (argument {name!r} got {type(v).__name__})")
    v = v.__index__()
    if v < 0:
        raise OverflowError(f"can't convert negative value to size_t ({name})")
    return v


# ------------------------------------------------------------------ handles
_handle_ids = itertools.count(0x7c00)
_handles = {}  # handle -> state


def create():
    h = next(_handle_ids)
    _handles[h] = {"stream": 0, "math": CUBLAS_DEFAULT_MATH, "pointer": CUBLAS_POINTER_MODE_HOST}
    return h


def destroy(handle):
    _state(handle)
    del _handles[handle]


def _state(handle):
    state = _handles.get(_c_int("handle", handle, 64))
    if state is None:
        raise _error("CUBLAS_STATUS_NOT_INITIALIZED")
    return state


def setStream(handle, stream):
    _state(handle)["stream"] = _size_t("stream", stream)


def getStream(handle):
    return _state(handle)["stream"]


def setMathMode(handle, mode):
    _state(handle)["math"] = _c_int("mode", mode)


def getMathMode(handle):
    return _state(handle)["math"]


def setPointerMode(handle, mode):
    _state(handle)["pointer"] = _c_int("mode", mode)


def getPointerMode(handle):
    return _state(handle)["pointer"]


def _set_current_stream(handle):
    """The binding's `_setStream`: every call runs on CuPy's current stream."""
    from cupy.cuda import get_current_stream

    setStream(handle, get_current_stream().ptr)


# ------------------------------------------------------------------ GEMM
def gemmEx(handle, transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype, ldc,
           computeType, algo):
    args = _convert(locals(), strided=False)
    _gemm(**args, strideA=0, strideB=0, strideC=0, batchCount=1, entry="gemmEx")


def gemmStridedBatchedEx(handle, transa, transb, m, n, k, alpha, A, Atype, lda, strideA, B, Btype, ldb, strideB,
                         beta, C, Ctype, ldc, strideC, batchCount, computeType, algo):
    args = _convert(locals(), strided=True)
    _gemm(**args, entry="gemmStridedBatchedEx")


def bf16_tensor_core(gemm):
    """`tensor_core_bf16` of a recorded GEMM (`cupy._record.Gemm`). A float32 product (CUDA_R_32F
    operands with CUBLAS_COMPUTE_32F) runs on the FP32 units: 19.5 instead of 312 TFLOP/s on an A100
    (NVIDIA A100 datasheet, https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf)."""
    return tensor_core_bf16(gemm.Atype, gemm.Btype, gemm.Ctype, gemm.computeType)


_INT_ARGS = ("transa", "transb", "m", "n", "k", "Atype", "lda", "Btype", "ldb", "Ctype", "ldc", "computeType", "algo")


def _convert(given, strided):
    out = {"handle": _c_int("handle", given["handle"], 64)}
    for name in _INT_ARGS + (("batchCount",) if strided else ()):
        out[name] = _c_int(name, given[name])
    for name in ("alpha", "A", "B", "beta", "C"):
        out[name] = _size_t(name, given[name])
    if strided:
        for name in ("strideA", "strideB", "strideC"):
            out[name] = _c_int(name, given[name], 64)
    return out


def _hip_shim(Atype, Btype, Ctype, computeType, algo):
    """CuPy 14.2's hipBLAS shim, in the order it fails (see the module docstring)."""
    if computeType >= CUBLAS_COMPUTE_16F or algo != CUBLAS_GEMM_DEFAULT:
        raise _error("CUBLAS_STATUS_NOT_SUPPORTED")
    for t in (Atype, Btype, Ctype):
        if not 0 <= t <= 9:
            raise ProcessAbort("terminate called after throwing an instance of 'std::runtime_error' "
                               f"what(): unrecognized type (cudaDataType {t} in CuPy's hipBLAS shim; "
                               "the process aborts on a ROCm device)")


def _gemm(handle, transa, transb, m, n, k, alpha, A, Atype, lda, strideA, B, Btype, ldb, strideB, beta, C, Ctype,
          ldc, strideC, batchCount, computeType, algo, entry, direct=False):
    """`direct`: called by the hipBLAS stand-in (hipblas_lib.py), not through CuPy's binding: the
    handle keeps the stream the caller set, and CuPy's hipBLAS shim is not in the way."""
    from cupy import _record

    state = _state(handle)
    if not direct:
        _set_current_stream(handle)
    if _record.active is not None:
        _record.note("hipblas.gemm" if direct else "cublas.gemm", f"A{Atype}", f"B{Btype}", f"C{Ctype}",
                     f"compute{computeType}", "batched" if batchCount != 1 or strideA or strideB or strideC else "single")
    if runtime.is_hip and not direct:
        _hip_shim(Atype, Btype, Ctype, computeType, algo)
    compute = compute_type(computeType)
    if compute not in _SUPPORTED or algo not in (CUBLAS_GEMM_DEFAULT, CUBLAS_GEMM_DEFAULT_TENSOR_OP) and not 0 <= algo <= 23:
        raise _error("CUBLAS_STATUS_INVALID_VALUE")
    if Atype != Btype or (Atype, Ctype) not in _SUPPORTED[compute]:
        raise _error("CUBLAS_STATUS_NOT_SUPPORTED")
    if computeType == CUBLAS_COMPUTE_32F_FAST_16BF:
        raise NotImplementedError("the stand-in does not model CUBLAS_COMPUTE_32F_FAST_16BF")
    a_rows, a_cols = (m, k) if transa == CUBLAS_OP_N else (k, m)
    b_rows, b_cols = (k, n) if transb == CUBLAS_OP_N else (n, k)
    if (transa not in (0, 1, 2) or transb not in (0, 1, 2) or min(m, n, k, batchCount) < 0
            or lda < max(1, a_rows) or ldb < max(1, b_rows) or ldc < max(1, m)):
        raise _error("CUBLAS_STATUS_INVALID_VALUE")
    if m == 0 or n == 0 or batchCount == 0:
        return
    if batchCount > 1 and abs(strideC) < ldc * n:
        raise ValueError(f"gemmStridedBatchedEx: strideC = {strideC} makes the {batchCount} outputs of "
                         f"{m} x {n} (ldc {ldc}) overlap (a write race on a GPU)")
    work = np.dtype(np.float64 if compute in (CUBLAS_COMPUTE_64F, CUBLAS_COMPUTE_64F_PEDANTIC) else np.float32)
    if _storage_dtype(Ctype).kind == "c":
        work = np.dtype(np.complex128 if work == np.float64 else np.complex64)
    scale = _scalars(state, work, alpha, beta)
    _record.note_gemm(_record.Gemm(entry, Atype, Btype, Ctype, computeType, algo, m, n, k, batchCount,
                                   bool(scale[1] == 0)))
    a = _matrices("A", A, _storage_dtype(Atype), a_rows, a_cols, lda, strideA, batchCount)
    b = _matrices("B", B, _storage_dtype(Btype), b_rows, b_cols, ldb, strideB, batchCount)
    c = _matrices("C", C, _storage_dtype(Ctype), m, n, ldc, strideC, batchCount)
    capture = _capture(state)
    _accesses(state, entry, ((A, a, False), (B, b, False), (C, c, True)))
    called(entry, batchCount, m, n, k, Atype, Btype, Ctype, computeType, beta_zero=bool(scale[1] == 0))
    from cupy import _memory

    if capture is not None:  # recorded: computed at each launch, with alpha and beta as read now
        from cupy.cuda import graph

        graph.record_quiet(capture, f"cuBLAS {entry}", lambda: _product(a, b, c, work, compute, transa, transb, scale),
                           [_memory.host_view(p, 1)[1] for p in (A, B, C)])
        return
    if _memory.META:  # shapes only: the checks above ran, nothing is computed
        return
    _product(a, b, c, work, compute, transa, transb, scale)


def _capture(state):
    """The capture a GEMM issued by the caller (not inside a CuPy call, which is recorded whole) joins."""
    from cupy import _tracked
    from cupy.cuda import _queue, graph

    if not _tracked._outermost():
        return None
    stream = next((s for s in _queue.Stream._live if s.ptr == state["stream"]), None)
    return None if stream is None else graph.device_work(stream)


def _product(a, b, c, work, compute, transa, transb, scale):
    """C = alpha op(A) op(B) + beta C on the views, in the work dtype."""
    a, b = a.astype(work), b.astype(work)
    if compute == CUBLAS_COMPUTE_32F_FAST_TF32 and work == np.float32:  # inputs rounded to TF32's 10-bit mantissa
        a, b = _tf32(a), _tf32(b)
    op = {CUBLAS_OP_N: lambda x: x, CUBLAS_OP_T: lambda x: x.transpose(0, 2, 1),
          CUBLAS_OP_C: lambda x: x.conj().transpose(0, 2, 1)}
    result = scale[0] * np.matmul(op[transa](a), op[transb](b))
    if scale[1] != 0:  # beta == 0: C is not read (it may hold anything, NaN included)
        result = result + scale[1] * c.astype(work)
    c[...] = result.astype(c.dtype)


def _tf32(x):
    """float32 values rounded to the nearest TF32 (8-bit exponent, 10-bit mantissa), ties away from zero."""
    bits = x.view(np.uint32)
    return ((bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)


def _accesses(state, entry, operands):
    """The GEMM's device accesses for the order tracking (cuda/_order.py), on the handle's stream
    (CuPy's current one, which the binding sets): A and B read, C written (with beta != 0 C is read
    too, which its write covers). Each operand counts as the byte range from its first to its last
    element (a leading dimension or batch stride larger than the matrix leaves gaps that count as
    touched); an empty one touches nothing."""
    from cupy.cuda import _order, _queue

    stream = next((s for s in _queue.Stream._live if s.ptr == state["stream"]), None)
    if stream is None:
        raise ValueError(f"the handle's stream {state['stream']:#x} is not a stream of this process")
    issued, where = _order.issue(stream), _order.call_site()
    for name, (ptr, view, write) in zip("ABC", operands):
        if view.size:
            nbytes = sum((n - 1) * s for n, s in zip(view.shape, view.strides)) + view.itemsize
            _order.access_pointer(ptr, nbytes, write, issued,
                                  f"cuBLAS {entry} ({name} {'written' if write else 'read'})", where)


def _scalars(state, work, alpha, beta):
    """alpha and beta, read where the pointer mode says they are (host memory by default)."""
    from cupy import _memory

    scale_ctype = {np.dtype(np.float32): ctypes.c_float, np.dtype(np.float64): ctypes.c_double}
    out = []
    for name, ptr in (("alpha", alpha), ("beta", beta)):
        if state["pointer"] == CUBLAS_POINTER_MODE_DEVICE:
            raw, _ = _memory.host_view(ptr, work.itemsize)
            out.append(raw.view(work)[0])
            continue
        try:
            _memory.host_view(ptr, 1)
        except (ValueError, IndexError):
            pass
        else:
            raise ValueError(f"{name} = {ptr:#x} is a device address, but the handle's pointer mode is HOST "
                             "(cuBLAS would read host memory there)")
        if ptr == 0:
            raise ValueError(f"{name} is a null pointer")
        if work.kind == "c":
            part = ctypes.c_double if work == np.complex128 else ctypes.c_float
            pair = (part * 2).from_address(ptr)
            out.append(complex(pair[0], pair[1]))
        else:
            out.append(work.type(scale_ctype[work].from_address(ptr).value))
    return out


def _matrices(name, ptr, dtype, rows, cols, ld, stride, batch):
    """A writable NumPy view [batch, rows, cols] of column-major matrices at device address `ptr`."""
    from cupy import _memory

    item = dtype.itemsize
    if stride < 0:
        raise ValueError(f"{name}: negative batch stride {stride}")
    extent = ((batch - 1) * stride + (cols - 1) * ld + rows) * item
    if ptr % min(item, 16):
        raise ValueError(f"{name} = {ptr:#x} is not aligned to its element size {item}")
    raw, _ = _memory.host_view(ptr, extent)
    return np.lib.stride_tricks.as_strided(raw.view(dtype), shape=(batch, rows, cols),
                                           strides=(stride * item, item, ld * item))


if runtime.model()["is_hip"]:  # a ROCm node has libhipblas beside CuPy: the stand-in's (hipblas_lib.py)
    from cupy.cuda import hipblas_lib

    hipblas_lib.install()
