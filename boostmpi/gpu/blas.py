"""Every matrix product of the GPU step, through cuBLAS's GEMMs (CuPy's bindings).

`matmul(a, b)` is `a @ b` over leading batch dimensions for CuPy arrays of float16, bfloat16,
float32 or float64, as one `cublasGemmEx` (one matrix) or `cublasGemmStridedBatchedEx` (a batch)
with float32 compute (float64 for float64) and the output rounded once to the operands' dtype, or
kept in float32 (`out` of float32 for 16-bit operands), or added to `out` (`accumulate`: beta = 1).
Batched products need it because CuPy 14.2's own `matmul` sends batched operands of any dtype
outside 'efdFD' to its integer GEMM kernel, which refuses bfloat16 (`TypeError: data type 'E' not
understood`; cupy/_core/_routines_linalg.pyx at v14.2.0, line 992). 2-D products need it for what
CuPy's `dot` cannot do: a float32 result or accumulation from bfloat16 operands (`dot` requires
out.dtype == result_type(a, b), line 484), operands that are column blocks of a wider matrix
(CuPy copies an operand that is neither C- nor F-contiguous, line 470; cuBLAS reads it in place
with its leading dimension), and bfloat16 on ROCm (below). CuPy's 2-D bfloat16 product itself
already runs bf16-in/fp32-accumulate on CUDA (tensordot_core_v11, line 702: CUBLAS_COMPUTE_32F,
CUBLAS_GEMM_DEFAULT_TENSOR_OP from compute capability 8.0). The NumPy path (`numpy.matmul`) is the
specification it is tested against.

Operands are passed as they lie in memory when cuBLAS can address them: each matrix row-major or
column-major with a leading dimension (a transposed view costs nothing: it is the other
`CUBLAS_OP_`), and the batch dimensions collapsible to one stride (a broadcast batch dimension is
stride 0). Anything else is copied once to a contiguous array. cuBLAS is column-major, so the
row-major product C = A @ B is computed as C^T = B^T A^T (the operands swap places).

Argument types follow the cuBLAS library guide's table for cublasGemmEx / cublasGemmStridedBatchedEx
(https://docs.nvidia.com/cuda/cublas/index.html#cublasgemmex): Atype = Btype = Ctype =
CUDA_R_16BF, CUDA_R_16F or CUDA_R_32F with CUBLAS_COMPUTE_32F and float scale factors;
CUDA_R_64F with CUBLAS_COMPUTE_64F and double ones. On ROCm the same binding goes through CuPy's
hipBLAS shim (cupy_backends/hip/cupy_hipblas.h at v14.2.0), which takes only the legacy
cudaDataType compute types (CUDA_R_32F -> HIPBLAS_COMPUTE_32F; a cuBLAS compute type returns
HIPBLAS_STATUS_NOT_SUPPORTED), only CUBLAS_GEMM_DEFAULT, and only the data types 0-9: it has no
mapping for CUDA_R_16BF and throws out of C code (the process aborts). So on ROCm a bfloat16
product calls hipBLAS's own GEMMs through ctypes (boostmpi.gpu.hipblas: bfloat16 operands, float32
compute, on CuPy's handle and current stream, in whichever of hipBLAS's ABIs the library speaks);
without libhipblas it is computed from float32 copies of the operands (HIP_R_32F throughout, float32
compute) and rounded once to bfloat16: the same numbers, more memory traffic.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from types import ModuleType

import numpy as np
import numpy.typing as npt

from boostmpi.arrays import Array
from boostmpi.gpu import cublas_capture, hipblas

_Scalars = dict[np.dtype[np.generic], npt.NDArray[np.float32 | np.float64]]  # one-element host arrays by dtype
_ONE: _Scalars = {np.dtype(np.float32): np.ones(1, np.float32), np.dtype(np.float64): np.ones(1, np.float64)}
_ZERO: _Scalars = {np.dtype(np.float32): np.zeros(1, np.float32), np.dtype(np.float64): np.zeros(1, np.float64)}


def _cuda_type(dtype: np.dtype[np.generic]) -> int:
    from cupy.cuda import runtime

    if dtype.name == "bfloat16":
        return runtime.CUDA_R_16BF
    return {np.dtype(np.float16): runtime.CUDA_R_16F, np.dtype(np.float32): runtime.CUDA_R_32F,
            np.dtype(np.float64): runtime.CUDA_R_64F}[dtype]


def supported(dtype: np.dtype[np.generic]) -> bool:
    return dtype.name == "bfloat16" or dtype in (np.float16, np.float32, np.float64)


def _collapse_batch(shape: Sequence[int], strides: Sequence[int]) -> tuple[int, int] | None:
    """One (count, stride) for the batch dimensions, or None when no single stride walks them."""
    dims = [(n, s) for n, s in zip(shape, strides) if n != 1]
    if not dims:
        return 1, 0
    count = math.prod(n for n, _ in dims)
    if all(s == 0 for _, s in dims):
        return count, 0
    for (n0, s0), (n1, s1) in zip(dims, dims[1:]):
        if s0 != s1 * n1:
            return None
    return count, dims[-1][1]


def _layout(x: Array, batch_shape: tuple[int, ...]) -> tuple[Array, int, int, int] | None:
    """(x, op, ld, batch stride) describing x [..., r, c] to cuBLAS as the column-major operand
    x^T, or None when its memory does not allow that without a copy. Strides in elements."""
    item = x.dtype.itemsize
    if any(s % item for s in x.strides):
        return None
    strides = [s // item for s in x.strides]
    r, c = x.shape[-2:]
    s0, s1 = strides[-2:]
    if c == 1:  # one column: the column stride is never used
        s1 = 1
    if r == 1:  # one row: the row stride is never used
        s0 = max(c, 1)
    if s1 == 1 and s0 >= max(1, c):
        op, ld = 0, s0  # row-major x: its memory is x^T in column-major order (CUBLAS_OP_N)
    elif s0 == 1 and s1 >= max(1, r):
        op, ld = 1, s1  # column-major x (a transposed view): CUBLAS_OP_T makes it x^T
    else:
        return None
    pad = len(batch_shape) - (x.ndim - 2)
    shape = (1,) * pad + tuple(x.shape[:-2])
    bstrides = [0 if n == 1 else s for n, s in zip(shape, [0] * pad + strides[:-2])]  # broadcast: stride 0
    batch = _collapse_batch(batch_shape, bstrides)
    if batch is None or any(s < 0 for s in bstrides):
        return None
    return x, op, ld, batch[1]


def _operand(x: Array, batch_shape: tuple[int, ...]) -> tuple[Array, int, int, int]:
    got = _layout(x, batch_shape)
    if got is None:
        xp = _cupy()
        full = xp.empty(tuple(batch_shape) + x.shape[-2:], dtype=x.dtype)
        full[...] = x  # broadcast and made contiguous in one copy
        got = _layout(full, batch_shape)
        assert got is not None  # a contiguous array always has one
    return got


def _cupy() -> ModuleType:
    import cupy

    return cupy


def _output(out: Array, batch_shape: tuple[int, ...], m: int, n: int) -> tuple[int, int]:
    """(ldc, batch stride) of a given output [..., m, n]: each matrix row-major with unit column
    stride (a column block of a wider matrix is fine: its row stride is the ldc) and the batch
    dimensions one stride; else ValueError (the caller passes a buffer cuBLAS can write)."""
    got = _layout(out, batch_shape)
    if out.shape != tuple(batch_shape) + (m, n) or got is None or got[1] != 0:
        raise ValueError(f"blas.matmul: out of shape {out.shape} and strides {out.strides} is not a row-major "
                         f"[{', '.join(map(str, tuple(batch_shape) + (m, n)))}] cuBLAS can write in place")
    return got[2], got[3]


def matmul(a: Array, b: Array, out: Array | None = None, accumulate: bool = False) -> Array:
    """a @ b for CuPy arrays [..., m, k] @ [..., k, n] (batch dimensions broadcast), of one float
    dtype, through one cuBLAS GEMM (gemmEx for one matrix, gemmStridedBatchedEx for a batch); float32
    compute for 16- and 32-bit floats. `out` receives the product (it may be float32 for 16-bit
    operands: the float32 accumulator stored without rounding) and with `accumulate` the product is
    added to what `out` holds (cuBLAS's beta = 1: a weight gradient accumulates with no temporary)."""
    xp = _cupy()
    from cupy.cuda import cublas, runtime

    if a.dtype != b.dtype or not supported(a.dtype) or a.ndim < 2 or b.ndim < 2:
        raise TypeError(f"blas.matmul takes two arrays of at least 2 dimensions and one float dtype, got "
                        f"{a.dtype}[{a.ndim}] and {b.dtype}[{b.ndim}]")
    (m, k), (k2, n) = a.shape[-2:], b.shape[-2:]
    if k != k2:
        raise ValueError(f"matmul: shapes {a.shape} and {b.shape} are not aligned")
    batch_shape = tuple(np.broadcast_shapes(a.shape[:-2], b.shape[:-2]))
    dtype = a.dtype
    if accumulate and out is None:
        raise ValueError("blas.matmul: accumulate needs the out array to add to")
    if out is not None and out.dtype != dtype and not (dtype.itemsize == 2 and out.dtype == np.float32):
        raise TypeError(f"blas.matmul: out of dtype {out.dtype} for {dtype} operands (the operands' dtype, or "
                        f"float32 for 16-bit ones)")
    via_hipblas = runtime.is_hip and dtype.name == "bfloat16"  # CuPy's hipBLAS shim has no bfloat16 (see above)
    if via_hipblas and hipblas.library() is None:  # no libhipblas: float32 copies
        hipblas.say_missing()
        a, b = a.astype(np.float32), b.astype(np.float32)
        if out is None:
            return matmul(a, b).astype(dtype)
        if out.dtype == np.float32:
            return matmul(a, b, out, accumulate)
        product = matmul(a, b)
        if accumulate:
            product += out
        out[...] = product
        return out
    if out is None:
        out = xp.empty(batch_shape + (m, n), dtype=dtype)
    ldc, stride_c = _output(out, batch_shape, m, n)
    count = math.prod(batch_shape)
    if out.size == 0:
        return out
    if k == 0:
        if not accumulate:
            out[...] = 0
        return out
    a, op_a, lda, stride_a = _operand(a, batch_shape)
    b, op_b, ldb, stride_b = _operand(b, batch_shape)
    scale = np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)
    beta = (_ONE if accumulate else _ZERO)[scale].ctypes.data
    if via_hipblas:  # hipBLAS's own bfloat16 GEMM on CuPy's handle, which must run on CuPy's current stream
        handle = xp.cuda.get_cublas_handle()
        cublas.setStream(handle, xp.cuda.get_current_stream().ptr)
        ops = (hipblas.HIPBLAS_OP_N, hipblas.HIPBLAS_OP_T)
        # row-major C [m, n] = A @ B is column-major C^T [n, m] = B^T A^T
        hipblas.gemm(handle, ops[op_b], ops[op_a], n, m, k, _ONE[scale].ctypes.data, b.data.ptr, ldb, stride_b,
                     a.data.ptr, lda, stride_a, beta, out.data.ptr, out.dtype == np.float32, ldc, stride_c, count)
        return out
    if runtime.is_hip:  # the legacy cudaDataType compute type, the only kind the hipBLAS shim takes
        compute = runtime.CUDA_R_64F if dtype == np.float64 else runtime.CUDA_R_32F
    else:
        compute = cublas.CUBLAS_COMPUTE_64F if dtype == np.float64 else cublas.CUBLAS_COMPUTE_32F
    t, tc = _cuda_type(dtype), _cuda_type(out.dtype)
    # row-major C [m, n] = A @ B is column-major C^T [n, m] = B^T A^T
    lib = cublas_capture.binding(cublas)  # CuPy's binding, or while a graph step is captured the library's own
    if count == 1:
        lib.gemmEx(xp.cuda.get_cublas_handle(), op_b, op_a, n, m, k, _ONE[scale].ctypes.data, b.data.ptr, t, ldb,
                      a.data.ptr, t, lda, beta, out.data.ptr, tc, ldc, compute, cublas.CUBLAS_GEMM_DEFAULT)
        return out
    lib.gemmStridedBatchedEx(
        xp.cuda.get_cublas_handle(), op_b, op_a, n, m, k,
        _ONE[scale].ctypes.data, b.data.ptr, t, ldb, stride_b, a.data.ptr, t, lda, stride_a,
        beta, out.data.ptr, tc, ldc, stride_c, count, compute, cublas.CUBLAS_GEMM_DEFAULT)
    return out
