"""The CuPy stand-in (testing/cupy_standin) behaves as CuPy where the project depends on it.

Only where the stand-in is in use (on a machine whose CuPy reaches a GPU the real one is tested by
the rest of the GPU suite instead). The dtype expectations are CuPy's rules as its sources state
them (ufunc loop tables with bfloat16 after float16, weak Python scalars checked through
numpy.result_type, matmul by promote_types), not NumPy's.
"""

import numpy as np
import pytest

from tests.support.gpu_setup import GPU

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not GPU.standin, reason="checks the CuPy stand-in; a real GPU is in use")]

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)


@pytest.fixture
def cupy():
    import cupy

    return cupy


def test_device_arrays_do_not_convert_implicitly(cupy):
    a = cupy.ones((2, 3), dtype=np.float32)
    with pytest.raises(TypeError, match="Implicit conversion to a NumPy array is not allowed"):
        np.asarray(a)
    with pytest.raises(TypeError, match="Unsupported type"):
        a + np.ones(3, np.float32)
    with pytest.raises(TypeError, match="Unsupported type"):
        np.ones(3, np.float32) * a
    with pytest.raises(TypeError, match="Unsupported type"):
        a[...] = np.zeros((2, 3), np.float32)
    assert isinstance(a.get(), np.ndarray) and float(a.sum()) == 6.0
    assert isinstance(a[0, 1], cupy.ndarray) and a[0, 1].shape == ()  # a 0-d device array, not a NumPy scalar


@pytest.mark.parametrize("expr,dtype", [
    ("bf * 1.0", np.float32),  # a weak float does not fit bfloat16's loop by numpy.result_type: the float32 loop
    ("bf * 2", BF16),  # a weak int does
    ("bf * bf", BF16),
    ("bf + f32", np.float32),
    ("bf @ bf", BF16),  # matmul: promote_types, cuBLAS in bfloat16
    ("bf @ f32", np.float32),
    ("cupy.exp(bf)", BF16),
    ("bf / bf", BF16),
    ("f32 * 1.0", np.float32),
    ("f32 * np.float64(1.0)", np.float64),  # a NumPy scalar is not weak
    ("i64 / 2", np.float64),
    ("i64 * 2", np.int64),
    ("bf.sum(axis=-1)", BF16),
    ("bf.mean()", BF16),
    ("(f32 * f32).sum(axis=-1, dtype=np.float64)", np.float64),
])
def test_cupys_type_rules(cupy, expr, dtype):
    env = {"cupy": cupy, "np": np, "bf": cupy.ones((2, 2), dtype=BF16), "f32": cupy.ones((2, 2), dtype=np.float32),
           "i64": cupy.arange(4).reshape(2, 2)}
    assert eval(expr, env).dtype == np.dtype(dtype), expr


def test_half_precision_sums_accumulate_in_float32(cupy):
    ones = cupy.ones(1000, dtype=BF16)
    assert float(ones.sum()) == 1000.0  # bfloat16 accumulation would stall at 256


def test_in_place_output_casts_same_kind_only(cupy):
    f = cupy.ones(3, dtype=np.float32)
    f *= 2.0
    assert f.dtype == np.float32
    i = cupy.ones(3, dtype=np.int64)
    with pytest.raises(TypeError, match="same_kind"):
        i *= 1.5


def test_empty_memory_is_not_zeroed(cupy):
    assert np.isnan(cupy.empty(4, dtype=np.float32).get()).all()


def test_using_allocator_makes_arrays_from_the_given_pool(cupy):
    """cupy/cuda/__init__.py:162 (v14.2.0): inside `using_allocator(pool.malloc)` every new array's
    memory comes from that pool (memory.pyx:892 `alloc`, the thread-local allocator first); the
    previous allocator is back after the block, also when it raises."""
    default, other = cupy.get_default_memory_pool(), cupy.cuda.MemoryPool()
    used = default.used_bytes()
    with cupy.cuda.using_allocator(other.malloc):
        a = cupy.empty(100, dtype=np.float32)
        b = a + 1  # an operation's result too
    assert other.used_bytes() == 1024 and default.used_bytes() == used
    c = cupy.empty(100, dtype=np.float32)
    assert other.used_bytes() == 1024 and default.used_bytes() == used + 512
    with pytest.raises(RuntimeError), cupy.cuda.using_allocator(other.malloc):
        raise RuntimeError
    d = cupy.empty(100, dtype=np.float32)
    assert other.used_bytes() == 1024 and default.used_bytes() == used + 1024
    del a, b
    assert other.used_bytes() == 0 and other.total_bytes() == 1024  # freed into its own pool
    del c, d


def test_memory_pool_statistics(cupy):
    pool = cupy.get_default_memory_pool()
    used, total = pool.used_bytes(), pool.total_bytes()
    a = cupy.empty(100, dtype=np.float32)  # 400 bytes: one 512-byte block
    assert pool.used_bytes() == used + 512
    held = pool.total_bytes()
    del a
    assert pool.used_bytes() == used and pool.total_bytes() == held >= total  # the block is kept for reuse
    b = cupy.empty(128, dtype=np.float32)  # the same 512-byte block again
    assert pool.total_bytes() == held
    del b
    in_use = pool.used_bytes()
    pool.free_all_blocks()
    # CuPy 14.2's pool gives back only free chunks that are a whole allocation (a free chunk split off
    # an allocation still partly in use stays held): the rules, each pinned with a fresh pool, are in
    # tests/emulators/cupy_standin/test_cupy_standin_pool.py
    assert pool.used_bytes() == in_use and in_use <= pool.total_bytes() <= held


@pytest.mark.parametrize("model,warp,sms", [("a100", 32, 108), ("h100", 32, 132), ("mi250x", 64, 110)])
def test_device_models_and_the_kernels_on_a_64_wide_wavefront(cupy, monkeypatch, model, warp, sms):
    from boostmpi.gpu import kernels
    from boostmpi.model import layers

    monkeypatch.setenv("BOOSTMPI_STANDIN_GPU", model)
    props = cupy.cuda.runtime.getDeviceProperties(0)
    assert (props["warpSize"], props["multiProcessorCount"]) == (warp, sms)
    for cached in (kernels._device_info, kernels._module):
        monkeypatch.setattr(kernels, cached.__name__, __import__("functools").lru_cache(maxsize=None)(cached.__wrapped__))
    assert kernels._current_device().warp_size == warp
    x = np.random.default_rng(0).standard_normal((3, 200)).astype(np.float32)
    y, _ = kernels.rmsnorm_forward(cupy.asarray(x), cupy.ones(200, dtype=np.float32), 1e-6)
    np.testing.assert_allclose(y.get(), layers.rmsnorm_forward(x, np.ones(200, np.float32), 1e-6)[0], rtol=2e-5, atol=2e-6)


def test_launch_limits_of_a_real_device(cupy):
    from cupy._kernel import CUDADriverError

    from boostmpi.gpu import kernels

    fn = kernels._kernel("lowrank", "silu_forward_f32")
    a = cupy.ones(8, dtype=np.float32)
    with pytest.raises(CUDADriverError, match="threads per block"):
        fn((1,), (2048,), (a, a, 8))
    assert fn.shared_size_bytes == 0  # the elementwise kernels use no shared memory
    assert kernels._kernel("rmsnorm", "rmsnorm_forward_f32").shared_size_bytes > 0  # block_reduce's partials
    with pytest.raises(CUDADriverError, match="without opting in"):
        fn((1,), (32,), (a, a, 8), shared_mem=64 * 1024)
    with pytest.raises(CUDADriverError, match="max_dynamic_shared_size_bytes"):
        fn.max_dynamic_shared_size_bytes = 1 << 20


def test_a_wrong_scalar_type_is_refused_at_launch(cupy):
    """The harness checks arguments against the C signature by CuPy's rules: a Python int is a long long."""
    from testing import cudaemu

    from boostmpi.gpu import kernels

    fn = kernels._kernel("rmsnorm", "rescale_rows_f32")
    P, ss = cupy.ones((2, 4), dtype=np.float32), cupy.ones(2, dtype=np.float32)
    with pytest.raises(cudaemu.LaunchError):
        fn((2,), (32,), (P, ss, P, 4, np.int32(16), np.float32(1e-6)))


def test_events_order_streams(cupy):
    s = cupy.cuda.Stream(non_blocking=True)
    e = cupy.cuda.Event()
    e.record(s)
    assert e.done and s.done
    cupy.cuda.get_current_stream().wait_event(e)
    with pytest.raises(RuntimeError, match="no device clock"):
        cupy.cuda.get_elapsed_time(e, e)
