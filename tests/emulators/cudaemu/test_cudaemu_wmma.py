"""The harness's matrix-core operations: CUDA's warp matrix functions (testing/cudaemu/include/mma.h:
nvcuda::wmma for bfloat16 16x16x16 with a float accumulator, as the CUDA C++ Programming Guide
("Warp Matrix Functions") and CUDA 12.9's crt/mma.h declare them), and AMD's
__builtin_amdgcn_mfma_f32_32x32x8bf16_1k (testing/cudaemu/prelude.h, in the lane layout of AMD's
Matrix Instruction Calculator for CDNA2; (e) below).

(a) a product kernel over every memory layout of A, B and the accumulator, with a stride wider
    than the tile and several k steps, equals NumPy's (float32 products of bfloat16 inputs);
(b) what CUDA leaves unspecified fails here: a kernel that assumes which element a lane's x[e]
    holds gets wrong numbers (the map is drawn per launch), while elementwise work on x[] (the
    same for every element) is right;
(c) what CUDA requires is checked: all lanes of the warp call, a 256-bit aligned pointer, a
    stride of a multiple of 16 bytes; WMMA on a 64-lane wavefront is an error;
(d) NVRTC compiles the same kernel text for sm_80, sm_90 and sm_100 with CUDA's own headers, CUDA 12's
    or 13's: with CUDA 12's wheels CuPy 14.2 puts only the runtime wheel's include directory on
    NVRTC's path, whose mma.h includes crt/mma.h from the nvcc wheel (nvidia-cuda-nvcc-cu12), so that
    directory must be added; CUDA 13's wheels share one include directory, crt/ from nvidia-cuda-crt;
(e) MFMA: a 32x32 product over three k steps, loaded and stored in AMD's documented lane layout,
    equals NumPy's on 64 lanes; on 32 lanes it is an error; hipRTC compiles the same text for
    gfx90a; an emulation with another layout fails the product check.
"""

import functools

import numpy as np
import pytest

from testing import cudaemu
from tests.support import gpu_compilers
from boostmpi.gpu import kernels as loader

pytestmark = pytest.mark.gpu

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)

PROBE = r"""
#include <mma.h>
#include <cuda_bf16.h>
using namespace nvcuda;

template <typename L> struct RowMajor { enum { value = 0 }; };
template <> struct RowMajor<wmma::row_major> { enum { value = 1 }; };

// out = 2 (c + a b) for a [16, 16 k_steps] and b [16 k_steps, 16], each stored row- or column-major
// with the given strides; one 16 x 16 tile per warp, warp w at out + w * 16 * 16 (row-major, ld 16)
template <typename LA, typename LB>
__device__ void product(const __nv_bfloat16* a, const __nv_bfloat16* b, const float* c, float* out, int k_steps,
                        int lda, int ldb, int ldc, int c_rows) {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, LA> fa;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, LB> fb;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
    wmma::load_matrix_sync(acc, c, ldc, c_rows ? wmma::mem_row_major : wmma::mem_col_major);
    for (int s = 0; s < k_steps; ++s) {
        wmma::load_matrix_sync(fa, a + (RowMajor<LA>::value ? 16 * s : 16 * s * lda), lda);
        wmma::load_matrix_sync(fb, b + (RowMajor<LB>::value ? 16 * s * ldb : 16 * s), ldb);
        wmma::mma_sync(acc, fa, fb, acc);
    }
    for (int e = 0; e < acc.num_elements; ++e) acc.x[e] *= 2.0f;  // the same for every element: layout-free
    const int warp = static_cast<int>(threadIdx.x) / 32;
    wmma::store_matrix_sync(out + warp * 256, acc, 16, wmma::mem_row_major);
}

#define PRODUCT(NAME, LA, LB)                                                                                   \
    extern "C" __global__ void NAME(const __nv_bfloat16* a, const __nv_bfloat16* b, const float* c, float* out, \
                                    int k_steps, int lda, int ldb, int ldc, int c_rows) {                      \
        product<wmma::LA, wmma::LB>(a, b, c, out, k_steps, lda, ldb, ldc, c_rows);                              \
    }
PRODUCT(product_rr, row_major, row_major)
PRODUCT(product_rc, row_major, col_major)
PRODUCT(product_cr, col_major, row_major)
PRODUCT(product_cc, col_major, col_major)

// assumes lane l's x[e] is row l / 2, column 8 (l % 2) + e of the accumulator: a layout CUDA does not promise
extern "C" __global__ void assumed_layout(const __nv_bfloat16* a, const __nv_bfloat16* b, float* out) {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::row_major> fb;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
    wmma::fill_fragment(acc, 0.0f);
    wmma::load_matrix_sync(fa, a, 16);
    wmma::load_matrix_sync(fb, b, 16);
    wmma::mma_sync(acc, fa, fb, acc);
    const int lane = static_cast<int>(threadIdx.x);
    for (int e = 0; e < acc.num_elements; ++e) out[(lane / 2) * 16 + 8 * (lane % 2) + e] = acc.x[e];
}

// half the warp loads a fragment
extern "C" __global__ void divergent(const __nv_bfloat16* a, float* out) {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa;
    if (threadIdx.x < 16) wmma::load_matrix_sync(fa, a, 16);
    out[threadIdx.x] = 0.0f;
}

// a fragment loaded at a pointer offset by `offset` elements, with leading dimension ld
extern "C" __global__ void load_at(const __nv_bfloat16* a, int offset, int ld, float* out) {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa;
    wmma::load_matrix_sync(fa, a + offset, ld);
    out[threadIdx.x] = 0.0f;
}
"""


@functools.lru_cache(maxsize=None)
def _module(warp=32):
    return cudaemu.Module(PROBE, loader.COMPILE_OPTIONS + (f"-DWARP_SIZE={warp}",))


def _stored(m, rows, ld):
    """m [r, c] placed in a buffer with leading dimension ld: row-major if rows, else column-major."""
    if not rows:
        m = m.T
    out = np.zeros((m.shape[0], ld), m.dtype)
    out[:, :m.shape[1]] = m
    return out


@pytest.mark.parametrize("layouts", ["rr", "rc", "cr", "cc"])
@pytest.mark.parametrize("c_rows", [1, 0], ids=["c_row", "c_col"])
def test_products_equal_numpy_for_every_layout(layouts, c_rows):
    rng = np.random.default_rng(7)
    k_steps, warps = 3, 2
    K = 16 * k_steps
    a = rng.standard_normal((16, K)).astype(BF16)
    b = rng.standard_normal((K, 16)).astype(BF16)
    c = rng.standard_normal((16, 16)).astype(np.float32)
    lda, ldb, ldc = K + 8, (16 if layouts[1] == "r" else K) + 8, 20  # strides wider than the tiles
    A = cudaemu.DeviceArray(_stored(a, layouts[0] == "r", lda))
    B = cudaemu.DeviceArray(_stored(b, layouts[1] == "r", ldb))
    C = cudaemu.DeviceArray(_stored(c, c_rows, ldc))
    out = cudaemu.DeviceArray(shape=(warps, 16, 16), dtype=np.float32)
    _module().get_function(f"product_{layouts}")((1,), (32 * warps,), (A, B, C, out, np.int32(k_steps), np.int32(lda),
                                                                      np.int32(ldb), np.int32(ldc), np.int32(c_rows)))
    want = 2 * (c.astype(np.float64) + a.astype(np.float64) @ b.astype(np.float64))
    for w in range(warps):
        np.testing.assert_allclose(out.get()[w], want, rtol=1e-5, atol=1e-5)


def test_a_kernel_assuming_the_fragment_layout_computes_wrong_numbers():
    rng = np.random.default_rng(8)
    a, b = (rng.standard_normal((16, 16)).astype(BF16) for _ in range(2))
    want = a.astype(np.float64) @ b.astype(np.float64)
    results = []
    for _ in range(2):  # two launches, two maps
        out = cudaemu.DeviceArray(shape=(16, 16), dtype=np.float32)
        _module().get_function("assumed_layout")((1,), (32,), (cudaemu.DeviceArray(a), cudaemu.DeviceArray(b), out))
        results.append(out.get())
        # every value of the product is there, in the wrong places
        np.testing.assert_allclose(np.sort(results[-1].ravel()), np.sort(want.ravel()), rtol=1e-5, atol=1e-5)
        assert not np.allclose(results[-1], want, rtol=1e-5, atol=1e-5)
    assert not np.array_equal(results[0], results[1]), "the element map is drawn anew per launch"


def test_every_lane_must_call():
    a = cudaemu.DeviceArray(np.zeros((16, 16), BF16))
    with pytest.raises((cudaemu.PartialWarpError, cudaemu.DeadlockError)):
        _module().get_function("divergent")((1,), (32,), (a, cudaemu.DeviceArray(shape=32, dtype=np.float32)))


@pytest.mark.parametrize("offset,ld,message", [(8, 16, "not 256-bit aligned"), (0, 20, "multiple of 16 bytes")],
                         ids=["misaligned pointer", "stride of 40 bytes"])
def test_alignment_and_stride_are_checked(offset, ld, message):
    a = cudaemu.DeviceArray(np.zeros((32, 32), BF16))
    with pytest.raises(cudaemu.KernelError, match=message):
        _module().get_function("load_at")((1,), (32,), (a, np.int32(offset), np.int32(ld),
                                                        cudaemu.DeviceArray(shape=32, dtype=np.float32)))


def test_wmma_on_a_64_lane_wavefront_is_an_error():
    a = cudaemu.DeviceArray(np.zeros((16, 16), BF16))
    with pytest.raises(cudaemu.KernelError, match="32-lane warp"):
        _module(64).get_function("load_at")((1,), (64,), (a, np.int32(0), np.int32(16),
                                                          cudaemu.DeviceArray(shape=64, dtype=np.float32)))


def crt_wheel_include():
    """-I<folder> holding CUDA's crt/mma.h in this environment's CUDA wheels, for NVRTC's include path:
    CUDA 12's nvcc wheel (nvidia/cuda_nvcc/include), CUDA 13's shared nvidia/cu13/include."""
    import importlib.util

    from boostmpi.gpu import tensor_cores

    major = gpu_compilers.cuda_major()
    spec = importlib.util.find_spec(tensor_cores.WHEEL_HEADERS[major][0])
    header_wheel = gpu_compilers.NVRTC_PACKAGES[major][3]
    assert spec is not None and spec.submodule_search_locations, \
        f"{header_wheel} is not installed (the {gpu_compilers.EXTRA[major]} extra brings it)"
    return f"-I{list(spec.submodule_search_locations)[0]}/include"


@pytest.mark.parametrize("arch", ["80", "90", "100"])
def test_nvrtc_compiles_the_probe_with_cudas_headers(arch):
    gpu_compilers.require("NVRTC")
    options = loader.COMPILE_OPTIONS + ("-DWARP_SIZE=32",)
    [without, with_crt] = gpu_compilers.nvrtc([(PROBE, options, arch), (PROBE, options + (crt_wheel_include(),), arch)])
    if gpu_compilers.cuda_major() == 12:  # one folder per wheel: crt/ is not on CuPy's path
        assert not without["ok"] and 'cannot open source file "crt/mma.h"' in without["log"], without["log"][-2000:]
    else:  # CUDA 13: CuPy's path already holds nvidia/cu13/include, crt/ with it
        assert without["ok"], without["log"][-4000:]
    assert with_crt["ok"], with_crt["log"][-4000:]
    compiled = {entry for entry, _ in gpu_compilers.ptxas_table(with_crt["log"])}
    assert {"product_rr", "product_cc", "assumed_layout"} <= compiled


# ---------------------------------------------------------------------------- mutations of the emulation
# Each one-line change to include/mma.h must fail the check above that covers it.
MMA_MUTATIONS = {
    "b read transposed": ("sum += A[r * 16 + k] * B[k * 16 + col];", "sum += A[r * 16 + k] * B[col * 16 + k];",
                          lambda: test_products_equal_numpy_for_every_layout("rr", 1)),
    "column-major memory read as row-major": ("return row_major_memory ? ", "return true ? ",
                                              lambda: test_products_equal_numpy_for_every_layout("cc", 0)),
    "lanes not made to meet": ("inline void converge(const void* p, unsigned ldm, int layout, int line) {",
                               "inline void converge(const void* p, unsigned ldm, int layout, int line) { return;",
                               test_every_lane_must_call),
    "alignment not checked": ("if (reinterpret_cast<unsigned long long>(p) % 32)", "if (false)",
                              lambda: test_alignment_and_stride_are_checked(8, 16, "not 256-bit aligned")),
}


@pytest.mark.parametrize("mutation", MMA_MUTATIONS)
def test_each_mutation_of_the_emulation_fails_its_check(monkeypatch, tmp_path, mutation):
    old, new, check = MMA_MUTATIONS[mutation]
    for header in cudaemu.INCLUDE.glob("*.h"):
        text = header.read_text()
        if header.name == "mma.h":
            assert text.count(old) == 1, f"the mutation's target is not one place in mma.h: {old!r}"
            text = text.replace(old, new)
        (tmp_path / header.name).write_text(text)
    monkeypatch.setattr(cudaemu, "INCLUDE", tmp_path)
    _module.cache_clear()
    try:
        with pytest.raises((AssertionError, pytest.fail.Exception)):
            check()
    finally:
        _module.cache_clear()


# ---------------------------------------------------------------------------- AMD: MFMA on gfx90a

MFMA_PROBE = r"""
typedef short bf16x4 __attribute__((vector_size(8)));
typedef float floatx16 __attribute__((vector_size(64)));

// d [32, 32] = a [32, K] b [K, 32] (row-major, bfloat16 bits) over K / 8 steps of one wavefront,
// each lane loading and storing the elements AMD's lane layout gives it (prelude.h)
extern "C" __global__ void mfma_product(const unsigned short* a, const unsigned short* b, float* d, int K) {
    const int lane = static_cast<int>(threadIdx.x);
    floatx16 acc;
    for (int r = 0; r < 16; ++r) acc[r] = 0.0f;
    for (int k0 = 0; k0 < K; k0 += 8) {
        bf16x4 av, bv;
        for (int e = 0; e < 4; ++e) {
            const int k = k0 + 4 * (lane / 32) + e;
            av[e] = static_cast<short>(a[(lane % 32) * K + k]);
            bv[e] = static_cast<short>(b[k * 32 + lane % 32]);
        }
        acc = __builtin_amdgcn_mfma_f32_32x32x8bf16_1k(av, bv, acc, 0, 0, 0);
    }
    for (int r = 0; r < 16; ++r) d[(8 * (r / 4) + 4 * (lane / 32) + r % 4) * 32 + lane % 32] = acc[r];
}
"""


@functools.lru_cache(maxsize=None)
def _mfma_module(warp=64):
    return cudaemu.Module(MFMA_PROBE, loader.COMPILE_OPTIONS + (f"-DWARP_SIZE={warp}",))


def check_mfma_product():
    rng = np.random.default_rng(9)
    K = 24
    a = rng.standard_normal((32, K)).astype(BF16)
    b = rng.standard_normal((K, 32)).astype(BF16)
    d = cudaemu.DeviceArray(shape=(32, 32), dtype=np.float32)
    _mfma_module().get_function("mfma_product")((1,), (64,), (cudaemu.DeviceArray(a.view(np.uint16)),
                                                               cudaemu.DeviceArray(b.view(np.uint16)), d, np.int32(K)))
    np.testing.assert_allclose(d.get(), a.astype(np.float64) @ b.astype(np.float64), rtol=1e-5, atol=1e-5)


def test_mfma_product_in_amds_lane_layout_equals_numpy():
    check_mfma_product()


def test_mfma_on_a_32_lane_warp_is_an_error():
    args = (cudaemu.DeviceArray(np.zeros(32 * 8, np.uint16)), cudaemu.DeviceArray(np.zeros(8 * 32, np.uint16)),
            cudaemu.DeviceArray(shape=(32, 32), dtype=np.float32), np.int32(8))
    with pytest.raises(cudaemu.KernelError, match="64-lane wavefront"):
        _mfma_module(32).get_function("mfma_product")((1,), (32,), args)


def test_hiprtc_compiles_the_mfma_probe_for_gfx90a():
    gpu_compilers.require("hipRTC")
    report = gpu_compilers.hiprtc(MFMA_PROBE, loader.COMPILE_OPTIONS + ("-DWARP_SIZE=64",))
    assert report["ok"] and report["code_bytes"] > 0, report["log"][-3000:]


# the emulated builtin with its output rows in another order than AMD's: the product check fails
@pytest.mark.parametrize("old,new", [("const int i = 8 * (r / 4) + 4 * (lane / 32) + r % 4, j = lane % 32;",
                                      "const int i = 4 * (r / 4) + 16 * (lane / 32) + r % 4, j = lane % 32;"),
                                     ("A[src % 32][4 * (src / 32) + e] =", "A[src % 32][e * 2 + src / 32] =")],
                         ids=["output rows", "a's k order"])
def test_a_mutated_mfma_emulation_fails_the_product_check(monkeypatch, tmp_path, old, new):
    text = (cudaemu.HERE / "prelude.h").read_text()
    assert text.count(old) == 1, old
    (tmp_path / "prelude.h").write_text(text.replace(old, new))
    (tmp_path / "runtime.cpp").write_text((cudaemu.HERE / "runtime.cpp").read_text())
    monkeypatch.setattr(cudaemu, "HERE", tmp_path)
    _mfma_module.cache_clear()
    try:
        with pytest.raises(AssertionError):
            check_mfma_product()
    finally:
        _mfma_module.cache_clear()
