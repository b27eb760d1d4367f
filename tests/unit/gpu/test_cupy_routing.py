"""The stand-in routes calls as CuPy 14.2.0 does, dtype by dtype, and fails where CuPy fails.

The expectations are read in CuPy's source at tag v14.2.0 (the stand-in's comments cite the
lines): `matmul` (cupy/_core/_routines_linalg.pyx), `where` (cupy/_sorting/search.py), `ufunc.at`
(cupy/_core/_routines_indexing.pyx), bfloat16 only with NumPy >= 2.1.2 (cupy/_util.pyx,
cupy/_core/_scalar.pyx), and the cuBLAS binding's argument conversion and hipBLAS shim
(cupy_backends/cuda/libs/cublas.pyx, cupy_backends/hip/cupy_hipblas.h). Then the engine's GPU
wrapper of cuBLAS's strided-batched GEMM (boostmpi.gpu.blas) against NumPy's matmul, and the
start-up check of the versions a bfloat16 GPU run needs.
"""

import subprocess
import sys

import numpy as np
import pytest

from tests.support.gpu_setup import GPU

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not GPU.standin, reason="checks the CuPy stand-in; a real GPU is in use")]

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(np.float16), BF16, np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.complex64),
          np.dtype(np.int32), np.dtype(np.int64)]


@pytest.fixture
def cupy():
    import cupy

    return cupy


@pytest.fixture
def rocm(cupy, monkeypatch):
    """The stand-in as CuPy on ROCm (its hipBLAS shim), for one test."""
    monkeypatch.setattr(cupy.cuda.runtime, "is_hip", True)
    return cupy


def _operands(cupy, dtype, shape_a, shape_b, seed=0):
    rng = np.random.default_rng(seed)
    a = (rng.standard_normal(shape_a) * 4).astype(dtype)
    b = (rng.standard_normal(shape_b) * 4).astype(dtype)
    return a, b, cupy.asarray(a), cupy.asarray(b)


# (shape of a, shape of b, what CuPy 14.2 does with bfloat16 there)
SHAPES = {
    "2-D": ((5, 3), (3, 4), "cuBLAS gemmEx"),
    "batched": ((2, 5, 3), (2, 3, 4), "integer GEMM kernel"),
    "batched, broadcast": ((1, 5, 3), (2, 3, 4), "integer GEMM kernel"),
    "batched @ 2-D": ((2, 2, 5, 3), (3, 4), "integer GEMM kernel"),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(SHAPES))
def test_matmul_routes_each_dtype_as_cupy_does(cupy, dtype, case):
    shape_a, shape_b, bf16_route = SHAPES[case]
    a, b, da, db = _operands(cupy, dtype, shape_a, shape_b)
    if dtype == BF16 and bf16_route == "integer GEMM kernel":
        with pytest.raises(TypeError, match="data type 'E' not understood"):
            cupy.matmul(da, db)
        with pytest.raises(TypeError, match="data type 'E' not understood"):
            da @ db
        return
    got = cupy.matmul(da, db)
    assert got.dtype == dtype
    work = np.float32 if dtype in (np.float16, BF16) else dtype  # 16-bit floats: float32 compute, one rounding
    want = np.matmul(a.astype(work), b.astype(work)).astype(dtype)
    np.testing.assert_allclose(got.get().astype(np.complex128), want.astype(np.complex128), rtol=1e-6)


def test_matmul_on_rocm_aborts_on_bfloat16_as_cupys_hipblas_shim_does(rocm):
    a, b, da, db = _operands(rocm, BF16, (5, 3), (3, 4))
    from cupy.cuda import cublas

    with pytest.raises(cublas.ProcessAbort, match="unrecognized type"):
        da @ db
    assert (da.astype(np.float32) @ db.astype(np.float32)).dtype == np.float32  # float32 is fine there


def test_where_and_scatter_add_on_bfloat16_follow_cupy(cupy):
    cond = cupy.asarray(np.array([True, False, True]))
    x, y = cupy.ones(3, dtype=BF16), cupy.zeros(3, dtype=BF16)
    assert cupy.where(cond, x, y).dtype == np.float32  # no bfloat16 loop: '?ff->f'
    assert cupy.where(cond, x.astype(np.float16), y.astype(np.float16)).dtype == np.float16
    assert cupy.where(cond, x.astype(np.int64), 0).dtype == np.int64
    with pytest.raises(ValueError, match="Unsupported dtype float8_e4m3fn"):  # no C type name in CuPy 14.2
        cupy.zeros(3, dtype=ml_dtypes.float8_e4m3fn)
    with pytest.raises(TypeError, match="cupy.add.at only supports int32, int64, float16, float32, float64"):
        cupy.add.at(cupy.zeros((4, 2), dtype=BF16), cupy.asarray(np.array([0, 0])), cupy.ones((2, 2), dtype=BF16))
    target = cupy.zeros((4, 2), dtype=np.float32)
    cupy.add.at(target, cupy.asarray(np.array([1, 1, 3])), cupy.ones((3, 2), dtype=BF16))  # cast to the target
    np.testing.assert_array_equal(target.get()[:, 0], [0, 2, 0, 1])
    with pytest.raises(TypeError, match="cupy.subtract.at only supports int32, uint32"):
        cupy.subtract.at(target, cupy.asarray(np.array([0])), 1.0)
    with pytest.raises(NotImplementedError, match="cupy_maximum.reduce"):
        cupy.maximum.reduce(target)


# (expression, result dtype): reductions by their loop tables (cupy/_core/_routines_math.pyx at
# v14.2.0, _sumprod_types line 786: '?->l', 'B->L', 'e->e' and bfloat16 accumulating in float;
# _sum_keep_dtype line 800 for dtype=; cupy/_core/_routines_statistics.pyx: _amax line 294,
# _mean_core line 647 with 'i->d'), casts through elementwise_copy (cupy/_core/_ufuncs.py line 7)
@pytest.mark.parametrize("expr,dtype", [
    ("b.sum()", np.int64), ("u8.sum()", np.uint64), ("i32.sum()", np.int64), ("i32.mean()", np.float64),
    ("bf.sum(axis=0)", BF16), ("bf.max(axis=0)", BF16), ("bf.mean(axis=0)", BF16),
    ("bf.sum(axis=0, dtype=np.float32)", np.float32), ("f32.sum(dtype=BF16)", BF16),
    ("bf.astype(np.int32)", np.int32), ("i32.astype(BF16)", BF16), ("f16.astype(BF16)", BF16),
])
def test_reductions_and_casts_take_cupys_loops(cupy, expr, dtype):
    env = {"np": np, "BF16": BF16, "b": cupy.ones(4, dtype=bool), "u8": cupy.ones(4, dtype=np.uint8),
           "i32": cupy.ones(4, dtype=np.int32), "f16": cupy.ones(4, dtype=np.float16),
           "f32": cupy.ones(4, dtype=np.float32), "bf": cupy.ones((300, 2), dtype=BF16)}
    got = eval(expr, env)  # noqa: S307 - the test's own expressions
    assert got.dtype == dtype, expr
    if expr.startswith("bf.sum"):
        assert float(got[0]) == 300.0  # accumulated in float32: a bfloat16 sum would stop at 256


def test_bfloat16_is_off_under_numpy_older_than_2_1_2():
    """CuPy 14.2 under NumPy 2.0: no bfloat16 arrays at all (the stand-in imported with NumPy
    reporting 2.0.2, in a process of its own)."""
    code = ("import numpy; numpy.__version__ = '2.0.2'\n"
            "import cupy, ml_dtypes\n"
            "assert not cupy.BF16_ENABLED\n"
            "try:\n    cupy.zeros(3, dtype=ml_dtypes.bfloat16)\n"
            "except ValueError as e:\n    print(e)\n"
            "assert (cupy.ones(2, dtype=numpy.float32) * 2).dtype == numpy.float32\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "Unsupported dtype bfloat16"


# ------------------------------------------------------------------ the cuBLAS binding
def _gemm_args(cupy, a, b, c, t, compute):
    """gemmStridedBatchedEx arguments for row-major c = a @ b (cuBLAS column-major: c^T = b^T a^T)."""
    from cupy.cuda import cublas

    batch, m, k = a.shape
    n = b.shape[2]
    one, zero = np.ones(1, np.float32), np.zeros(1, np.float32)
    args = dict(handle=cupy.cuda.get_cublas_handle(), transa=cublas.CUBLAS_OP_N, transb=cublas.CUBLAS_OP_N,
                m=n, n=m, k=k, alpha=one.ctypes.data, A=b.data.ptr, Atype=t, lda=n, strideA=k * n,
                B=a.data.ptr, Btype=t, ldb=k, strideB=m * k, beta=zero.ctypes.data, C=c.data.ptr, Ctype=t,
                ldc=n, strideC=m * n, batchCount=batch, computeType=compute, algo=cublas.CUBLAS_GEMM_DEFAULT)
    return args, (one, zero)


def test_cublas_strided_batched_gemm_computes_in_float32_and_rounds_once(cupy):
    from cupy.cuda import cublas, runtime

    a, b, da, db = _operands(cupy, BF16, (3, 5, 4), (3, 4, 6))
    dc = cupy.empty((3, 5, 6), dtype=BF16)
    args, keep = _gemm_args(cupy, da, db, dc, runtime.CUDA_R_16BF, cublas.CUBLAS_COMPUTE_32F)
    cublas.gemmStridedBatchedEx(**args)
    np.testing.assert_array_equal(dc.get(), np.matmul(a.astype(np.float32), b.astype(np.float32)).astype(BF16))


@pytest.mark.parametrize("change,error,match", [
    (dict(m=5.0), TypeError, "integer"),  # Cython's C int takes integers only
    (dict(m=2 ** 31), OverflowError, "too large"),
    (dict(alpha=-1), OverflowError, "size_t"),
    (dict(m=-1), "CUBLASError", "CUBLAS_STATUS_INVALID_VALUE"),
    (dict(lda=1), "CUBLASError", "CUBLAS_STATUS_INVALID_VALUE"),  # lda below the rows of A
    (dict(Ctype=2), "CUBLASError", "CUBLAS_STATUS_NOT_SUPPORTED"),  # bf16 inputs, fp16 output: not in the table
    (dict(computeType=70), "CUBLASError", "CUBLAS_STATUS_NOT_SUPPORTED"),  # COMPUTE_64F on bf16
    (dict(transa=5), "CUBLASError", "CUBLAS_STATUS_INVALID_VALUE"),
    (dict(alpha="A"), ValueError, "device address"),  # a device pointer where the host pointer mode reads host memory
    (dict(strideC=0), ValueError, "overlap"),
    (dict(batchCount=100), ValueError, "not inside a live allocation"),  # batches past the allocations
])
def test_cublas_binding_refuses_what_cupy_and_cublas_refuse(cupy, change, error, match):
    from cupy.cuda import cublas, runtime

    _, _, da, db = _operands(cupy, BF16, (2, 5, 4), (2, 4, 6))
    dc = cupy.empty((2, 5, 6), dtype=BF16)
    args, keep = _gemm_args(cupy, da, db, dc, runtime.CUDA_R_16BF, cublas.CUBLAS_COMPUTE_32F)
    args.update({k: (args[v] if isinstance(v, str) else v) for k, v in change.items()})
    with pytest.raises(cublas.CUBLASError if error == "CUBLASError" else error, match=match):
        cublas.gemmStridedBatchedEx(**args)


def test_cublas_on_rocm_takes_legacy_compute_types_and_no_bfloat16(rocm):
    from cupy.cuda import cublas, runtime

    _, _, da, db = _operands(rocm, np.float32, (2, 5, 4), (2, 4, 6))
    dc = rocm.empty((2, 5, 6), dtype=np.float32)
    args, keep = _gemm_args(rocm, da, db, dc, runtime.CUDA_R_32F, cublas.CUBLAS_COMPUTE_32F)
    with pytest.raises(cublas.CUBLASError, match="HIPBLAS_STATUS_NOT_SUPPORTED"):  # the shim's _v11 entry
        cublas.gemmStridedBatchedEx(**args)
    with pytest.raises(cublas.CUBLASError, match="HIPBLAS_STATUS_NOT_SUPPORTED"):  # only CUBLAS_GEMM_DEFAULT
        cublas.gemmStridedBatchedEx(**dict(args, computeType=runtime.CUDA_R_32F, algo=cublas.CUBLAS_GEMM_DEFAULT_TENSOR_OP))
    cublas.gemmStridedBatchedEx(**dict(args, computeType=runtime.CUDA_R_32F))
    with pytest.raises(cublas.ProcessAbort, match="unrecognized type"):
        cublas.gemmStridedBatchedEx(**dict(args, Atype=runtime.CUDA_R_16BF, Btype=runtime.CUDA_R_16BF,
                                           Ctype=runtime.CUDA_R_16BF, computeType=runtime.CUDA_R_32F))


# ------------------------------------------------------------------ boostmpi.gpu.blas
def _views(cupy, a, b, layout):
    """Device operands in the memory layouts the engine hands to batched products."""
    if layout == "contiguous":
        return cupy.asarray(a), cupy.asarray(b)
    if layout == "transposed views":  # a^T and b^T stored, read through .transpose (CUBLAS_OP_T)
        return (cupy.asarray(np.ascontiguousarray(a.swapaxes(-1, -2))).swapaxes(-1, -2),
                cupy.asarray(np.ascontiguousarray(b.swapaxes(-1, -2))).swapaxes(-1, -2))
    if layout == "row slices":  # the first rows of a longer buffer (kh[:, :, :t1]): a leading dimension
        big = np.concatenate([b, b], axis=-2)
        return cupy.asarray(a), cupy.asarray(big)[..., : b.shape[-2], :]
    if layout == "strided batch":  # every other batch entry: no single batch stride after a copy-free view
        return cupy.asarray(np.stack([a, a], axis=1))[:, 0], cupy.asarray(b)
    raise AssertionError(layout)


@pytest.mark.parametrize("dtype", [BF16, np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)], ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "transposed views", "row slices", "strided batch"])
@pytest.mark.parametrize("shapes", [((2, 3, 5, 4), (2, 3, 4, 6)), ((2, 3, 5, 4), (1, 3, 4, 6)), ((1, 3, 5, 4), (2, 1, 4, 6)),
                                    ((4, 5, 4), (4, 6)), ((5, 4), (4, 6)), ((3, 5, 1), (3, 1, 6))],
                         ids=["4-D", "broadcast", "broadcast both", "batched @ 2-D", "2-D", "k = 1"])
def test_gpu_batched_matmul_matches_numpy(cupy, dtype, layout, shapes):
    from boostmpi.gpu import blas
    from cupy import _record

    a, b, _, _ = _operands(cupy, dtype, *shapes)
    if layout == "strided batch" and len(shapes[0]) < 4:
        layout = "contiguous"
    da, db = _views(cupy, a, b, layout)
    with _record.recording() as calls:
        got = blas.matmul(da, db)
    assert got.dtype == dtype and any(c.startswith("cublas.gemm") for c in calls)
    assert not any(c.startswith("matmul") for c in calls)  # never CuPy's own matmul
    work = np.float64 if dtype == np.float64 else np.float32
    want = np.matmul(a.astype(work), b.astype(work))
    tol = {np.dtype(np.float64): 1e-12, np.dtype(np.float32): 1e-5}.get(dtype, 2.0 ** -7)
    np.testing.assert_allclose(got.get().astype(np.float64), want, rtol=tol, atol=tol * np.abs(want).max())


@pytest.fixture
def hipblas_standin(rocm, monkeypatch):
    """ROCm with libhipblas beside CuPy: the stand-in's (cupy/cuda/hipblas_lib.py), on $ROCM_PATH."""
    from boostmpi.gpu import hipblas
    from tests.support.gpu_setup import use_hipblas_standin

    yield use_hipblas_standin(monkeypatch)
    hipblas.library.cache_clear()


def test_gpu_bfloat16_matmul_on_rocm_is_hipblas_own_gemm(hipblas_standin):
    """bfloat16 on ROCm (the stand-in's default libhipblas: hipBLAS 3 of ROCm 7): hipblasGemmStridedBatchedEx /
    hipblasGemmEx with HIP_R_16BF operands and HIPBLAS_COMPUTE_32F, through ctypes and a real C call,
    never CuPy's shim; the product is the float32 one rounded once (or kept in float32, or accumulated)."""
    from boostmpi.gpu import blas
    from cupy import _record

    import cupy

    a, b, da, db = _operands(cupy, BF16, (3, 5, 4), (3, 4, 6))
    with _record.recording() as calls:
        got = blas.matmul(da, db)
    assert got.dtype == BF16
    assert "hipblas.gemm A14 B14 C14 compute0 batched" in calls and not any(c.startswith("cublas.gemm") for c in calls)
    np.testing.assert_array_equal(got.get(), np.matmul(a.astype(np.float32), b.astype(np.float32)).astype(BF16))
    assert hipblas_standin.calls[-1] == ("hipblasGemmStridedBatchedEx", 14, 14, 14, 2, 160)
    out = cupy.ones((5, 6), np.float32)
    blas.matmul(da[0], db[0], out=out, accumulate=True)
    assert hipblas_standin.calls[-1] == ("hipblasGemmEx", 14, 14, 0, 2, 160)
    np.testing.assert_allclose(out.get(), 1 + a[0].astype(np.float32) @ b[0].astype(np.float32), rtol=1e-6)


def test_without_libhipblas_a_bfloat16_product_on_rocm_runs_on_float32_copies_and_says_so_once(rocm, monkeypatch, capsys):
    from boostmpi.gpu import blas, hipblas
    from cupy import _record

    monkeypatch.setattr(hipblas, "library", lambda: None)
    hipblas.say_missing.cache_clear()
    a, b, da, db = _operands(rocm, BF16, (3, 5, 4), (3, 4, 6))
    for _ in range(2):
        with _record.recording() as calls:
            got = blas.matmul(da, db)
    assert got.dtype == BF16
    assert calls >= {"cublas.gemm A0 B0 C0 compute0 batched"} and not any("A14" in c for c in calls)
    np.testing.assert_array_equal(got.get(), np.matmul(a.astype(np.float32), b.astype(np.float32)).astype(BF16))
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "libhipblas was not found" in err[0], err


@pytest.mark.parametrize("dtype,tf32,want", [
    (BF16, "0", (14, 14, 14, 68)), (np.dtype(np.float16), "0", (2, 2, 2, 68)), (np.dtype(np.float32), "0", (0, 0, 0, 68)),
    (np.dtype(np.float32), "1", (0, 0, 0, 77)), (np.dtype(np.float64), "1", (1, 1, 1, 70))], ids=str)
def test_2d_matmul_is_one_gemmex_with_cupys_compute_type(cupy, monkeypatch, dtype, tf32, want):
    """CuPy 14.2's 2-D matmul on CUDA (tensordot_core_v11, _routines_linalg.pyx line 702): one gemmEx
    with the operands' cudaDataType, CUBLAS_COMPUTE_32F for 16- and 32-bit floats (CUBLAS_COMPUTE_32F_FAST_TF32
    for float32 under CUPY_TF32 > 0, read by get_compute_type, line 448), CUBLAS_COMPUTE_64F for float64,
    algo CUBLAS_GEMM_DEFAULT_TENSOR_OP on compute capability 8.0; the stand-in records it."""
    from cupy import _record
    from cupy.cuda import cublas

    monkeypatch.setenv("CUPY_TF32", tf32)
    a, b, da, db = _operands(cupy, dtype, (5, 3), (3, 4))
    with _record.gemms() as log:
        got = da @ db
        cols = da @ cupy.asarray(np.ascontiguousarray(b.T)).T  # an F-contiguous operand: CUBLAS_OP_T, no copy
    work = np.float32 if dtype.itemsize <= 4 else np.float64
    want_value = np.matmul(a.astype(work), b.astype(work)).astype(dtype)
    tol = 2.0 ** -10 if want[3] == 77 else 1e-6  # TF32 keeps 10 bits of the inputs' mantissa
    np.testing.assert_allclose(got.get().astype(np.float64), want_value, rtol=tol, atol=tol * np.abs(want_value).max())
    np.testing.assert_array_equal(cols.get(), got.get())
    assert (want[3] == 77) == (not np.array_equal(got.get(), want_value))  # TF32 rounds what full float32 does not
    g = log[0]
    assert (g.entry, g.Atype, g.Btype, g.Ctype, g.computeType, g.algo) == ("gemmEx",) + want + (
        cublas.CUBLAS_GEMM_DEFAULT_TENSOR_OP,)
    assert (g.m, g.n, g.k, g.batch) == (4, 5, 3, 1)
    assert cublas.bf16_tensor_core(g) == (dtype == BF16)


def test_a_mixed_2d_matmul_runs_in_float32_off_the_tensor_cores(cupy):
    """bfloat16 @ float32: CuPy casts both to float32 (tensordot_core line 580), a float32 GEMM."""
    from cupy import _record
    from cupy.cuda import cublas

    a, _, da, _ = _operands(cupy, BF16, (5, 3), (3, 4))
    _, b, _, db = _operands(cupy, np.float32, (5, 3), (3, 4))
    with _record.gemms() as log:
        got = da @ db
    assert got.dtype == np.float32 and [(g.Atype, g.computeType) for g in log] == [(0, 68)]
    assert not cublas.bf16_tensor_core(log[0])


@pytest.mark.parametrize("compute,atype,ctype,on", [
    ("CUBLAS_COMPUTE_32F", 14, 14, True), ("CUBLAS_COMPUTE_32F", 14, 0, True), ("CUDA_R_32F", 14, 14, True),
    ("CUBLAS_COMPUTE_32F_PEDANTIC", 14, 14, False), ("CUBLAS_COMPUTE_32F", 0, 0, False),
    ("CUBLAS_COMPUTE_32F_FAST_16BF", 0, 0, False), ("CUBLAS_COMPUTE_16F", 2, 2, False)])
def test_bf16_tensor_core_follows_the_cublas_type_table(cupy, compute, atype, ctype, on):
    from cupy import _record
    from cupy.cuda import cublas, runtime

    value = getattr(cublas, compute, None)
    value = getattr(runtime, compute) if value is None else value
    g = _record.Gemm("gemmEx", atype, atype, ctype, value, -1, 4, 5, 3, 1, True)
    assert cublas.bf16_tensor_core(g) is on


@pytest.mark.parametrize("dtype", [BF16, np.dtype(np.float32)], ids=str)
@pytest.mark.parametrize("batch", [(), (3,)], ids=["2-D", "batched"])
def test_gpu_matmul_writes_and_accumulates_in_place(cupy, dtype, batch):
    """blas.matmul(out=..., accumulate=True): the product added to a float32 column block of a wider
    matrix by the GEMM itself (beta = 1), the bfloat16 operands' float32 accumulator never rounded."""
    from boostmpi.gpu import blas
    from cupy import _record

    a, b, da, db = _operands(cupy, dtype, batch + (5, 3), batch + (3, 4))
    base = np.random.default_rng(1).standard_normal(batch + (5, 7)).astype(np.float32)
    dbig = cupy.asarray(base)
    with _record.gemms() as log:
        blas.matmul(da, db, out=dbig[..., 2:6], accumulate=True)
    want = base.copy()
    want[..., 2:6] += np.matmul(a.astype(np.float32), b.astype(np.float32))
    np.testing.assert_allclose(dbig.get(), want, rtol=1e-6, atol=1e-5)
    assert [(g.entry, g.Ctype, g.beta_zero) for g in log] == [("gemmEx" if not batch else "gemmStridedBatchedEx", 0, False)]
    with pytest.raises(ValueError, match="cuBLAS can write in place"):
        blas.matmul(da, db, out=cupy.zeros(batch + (4, 5), np.float32).swapaxes(-1, -2))
    with pytest.raises(TypeError, match="out of dtype"):
        blas.matmul(da, db, out=cupy.zeros(batch + (5, 4), np.float64))


# ------------------------------------------------------------------ start-up
def test_bf16_gpu_problem_names_what_to_install():
    from boostmpi.backend import bf16_gpu_problem

    assert bf16_gpu_problem("14.2.0", "2.4.6", "0.6.0") is None
    line = bf16_gpu_problem("13.6.0", "2.0.2", None)
    assert "\n" not in line
    for fragment in ("CuPy >= 14.2 (found 13.6.0)", "NumPy >= 2.1.2 (found 2.0.2)", "ml_dtypes >= 0.5 (found none)",
                     "pip install 'cupy-cuda12x[ctk]>=14.2,<14.3' 'numpy>=2.1.2'", "CUDA 13: 'cupy-cuda13x[ctk]>=14.2,<14.3'"):
        assert fragment in line, line


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    from tests.support.train_helpers import write_text_shards

    return write_text_shards(tmp_path_factory.mktemp("text"), max_bytes=60_000)


@pytest.mark.parametrize("what,patch,fragment", [
    ("an older CuPy", ("cupy", "__version__", "13.6.0+standin"), "CuPy >= 14.2 (found 13.6.0+standin)"),
    ("an older NumPy", ("numpy", "__version__", "2.0.2"), "NumPy >= 2.1.2 (found 2.0.2)"),
])
def test_a_bf16_gpu_run_with_an_older_stack_is_refused_in_one_line(cupy, monkeypatch, shards, tmp_path, capfd,
                                                                   what, patch, fragment):
    from tests.support.train_helpers import assert_refused, train_argv

    module, name, value = patch
    monkeypatch.setattr(cupy if module == "cupy" else np, name, value)
    run_dir = tmp_path / "run"
    assert_refused(capfd, train_argv(run_dir, *shards, "train.device=gpu", "train.dtype=bfloat16"), tmp_path,
                   fragment, "pip install")


def test_a_bf16_step_runs_on_rocm_through_float32_copies_without_libhipblas(rocm, monkeypatch):
    """bfloat16 on ROCm without libhipblas: CuPy 14.2's hipBLAS shim has no bfloat16 type, so every
    product of the step goes through boostmpi.gpu.blas, which multiplies float32 copies there: no GEMM
    reaches the shim with CUDA_R_16BF. Mutant: the 2-D products back on CuPy's own matmul abort the
    process, as they would on an MI250X."""
    from boostmpi.gpu import hipblas
    from boostmpi.model import layers
    from cupy import _record
    from cupy.cuda import cublas
    from tests.support.gpu_steps import step

    monkeypatch.setattr(hipblas, "library", lambda: None)
    with _record.gemms() as log:
        step("cola", "gpu", "bfloat16")
    assert log and all(g.Atype == g.Btype == rocm.cuda.runtime.CUDA_R_32F for g in log), log
    matmul = layers.matmul
    monkeypatch.setattr(layers, "matmul", lambda a, b, out=None, accumulate=False, dtype=None:
                        a @ b if out is None and dtype is None and a.ndim == b.ndim == 2 else matmul(a, b, out, accumulate, dtype))
    for module in ("btp", "base", "vanilla", "megatron"):
        monkeypatch.setattr(f"boostmpi.parallel.tensor_parallel.{module}.matmul", layers.matmul)
    with pytest.raises(cublas.ProcessAbort, match="unrecognized type"):
        step("cola", "gpu", "bfloat16")


def test_a_cublas_gemm_reads_and_writes_on_its_stream(cupy):
    """The stand-in's cuBLAS binding feeds the happens-before tracking (cuda/_order.py): a GEMM on a
    side stream writes C there, so reading C on the current stream without a wait is reported, and
    a GEMM reading an operand still being written on another stream is too."""
    from boostmpi.gpu import blas
    from cupy.cuda._order import StreamOrderError

    a, b, da, db = _operands(cupy, BF16, (5, 3), (3, 4))
    side = cupy.cuda.Stream(non_blocking=True)
    side.wait_event(cupy.cuda.get_current_stream().record())
    with side:
        c = blas.matmul(da, db)
    with pytest.raises(StreamOrderError, match="cuBLAS gemmEx"):
        c + c
    cupy.cuda.get_current_stream().wait_event(side.record())
    np.testing.assert_array_equal((c + c).get(), 2 * np.matmul(a.astype(np.float32), b.astype(np.float32)).astype(BF16))
    with side:
        d = da * 2  # written on the side stream
    with pytest.raises(StreamOrderError, match="cuBLAS gemmEx"):
        blas.matmul(d, db)
    cupy.cuda.Device().synchronize()


def test_a_bf16_step_on_rocm_runs_every_product_on_hipblas_bf16_gemms(hipblas_standin):
    """bfloat16 on ROCm with libhipblas: every product of the step is one of hipBLAS's own GEMMs with
    bfloat16 operands and float32 compute (what the MI250X's matrix cores run), none on float32 copies,
    none through CuPy's shim; the step equals the CPU path within the bfloat16 tolerance."""
    from cupy import _record
    from tests.support.gpu_steps import step
    from tests.integration.gpu.test_gpu import assert_step_close, cpu_step

    with _record.gemms() as log:
        got = step("cola", "gpu", "bfloat16")
    assert log and all(g.entry.startswith("hipblas") and g.Atype == g.Btype == 14 and g.computeType == 0
                       for g in log), sorted({(g.entry, g.Atype, g.Ctype, g.computeType) for g in log})
    assert_step_close(got, cpu_step("cola"), "bfloat16", "cola bfloat16 on hipBLAS")
