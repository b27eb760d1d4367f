"""The tensor-core forward of the fused attention (kernels/attention.cu, attention_forward_tc_bf16),
an option OFF by default: compiled only with -DBOOSTMPI_ATTENTION_WMMA and launched by no wrapper.

On the execution harness (its WMMA draws the fragment element map at random per launch, so a
kernel assuming a layout fails) against the model's NumPy attention: O within twice the error of a
float32 reference that rounds P and O to bfloat16, the log-sum-exp within 1e-5; NVRTC compiles it for
sm_80 and sm_90 (with CUDA's crt/ headers on the include path) without spills and with two
resident blocks per SM; the default text has no such entry point; mutations fail the check.
"""

import functools

import numpy as np
import pytest

import cudaemu
import gpu_compilers
from boostmpi.gpu import kernels as loader
from test_attention_kernel import BF16, F32_TOLERANCE, _inputs, max_error, rounded_reference, specification
from test_cudaemu_wmma import nvcc_wheel_include
from test_kernel_resources import MIN_RESIDENT_BLOCKS, nvidia_resident_blocks

pytestmark = pytest.mark.gpu

OPTION = "-DBOOSTMPI_ATTENTION_WMMA"
THREADS = 128
ENTRY = "attention_forward_tc_bf16"


@functools.lru_cache(maxsize=None)
def _module(code):
    return cudaemu.Module(code, loader.COMPILE_OPTIONS + ("-DWARP_SIZE=32", OPTION))


def check_forward(B, T, H, Hkv, Dh, code=None):
    q, k, v, do = _inputs(B, T, H, Hkv, Dh, BF16)
    o = cudaemu.DeviceArray(shape=q.shape, dtype=BF16)
    lse = cudaemu.DeviceArray(shape=(B, H, T), dtype=np.float32)
    grid = B * H * -(-T // loader.ATTENTION_QUERY_TILE)
    _module(code or loader.kernel_source("attention")).get_function(ENTRY)(
        (grid,), (THREADS,), (cudaemu.DeviceArray(q), cudaemu.DeviceArray(k), cudaemu.DeviceArray(v), o, lse,
                              *loader._attention_scalars(T, H, Hkv, Dh)))
    want_o, want_lse = specification(q, k, v, do)[:2]
    assert max_error(lse.get(), want_lse) <= F32_TOLERANCE * max(float(np.max(np.abs(want_lse))), 1.0), "lse"
    reference = rounded_reference(q, k, v, do)[0]
    assert max_error(o.get(), want_o) <= 2 * max_error(reference, want_o) + 1e-30, \
        f"o: kernel error {max_error(o.get(), want_o):.3g}, rounded reference {max_error(reference, want_o):.3g}"


# T = 1, T below and not a multiple of the tiles (a second query tile meets two key tiles), GQA, Dh 64 and 128
@pytest.mark.parametrize("shape", [(1, 1, 2, 1, 64), (1, 70, 4, 2, 128), (2, 37, 2, 2, 96)],
                         ids=lambda s: "B{}_T{}_H{}_Hkv{}_Dh{}".format(*s))
def test_tensor_core_forward_matches_the_model(shape):
    check_forward(*shape)


def test_the_option_is_off_by_default():
    default = cudaemu.Module(loader.kernel_source("attention"), loader.COMPILE_OPTIONS + ("-DWARP_SIZE=32",))
    assert ENTRY not in default.entry_points and ENTRY in _module(loader.kernel_source("attention")).entry_points


def test_nvrtc_compiles_it_within_the_budget():
    gpu_compilers.require("NVRTC")
    options = loader.COMPILE_OPTIONS + ("-DWARP_SIZE=32", OPTION, nvcc_wheel_include())
    reports = gpu_compilers.nvrtc([(loader.kernel_source("attention"), options, arch) for arch in ("80", "90")])
    for report in reports:
        assert report["ok"], report["log"][-4000:]
        for (entry, arch), info in gpu_compilers.ptxas_table(report["log"]).items():
            if entry != ENTRY:
                continue
            assert info["spills"] == 0 and info["stack"] == 0, (arch, info)
            blocks = nvidia_resident_blocks(arch, info["registers"], THREADS, info["smem"])
            assert blocks >= MIN_RESIDENT_BLOCKS, (arch, info, blocks)


MUTATIONS = {
    # the row of a fragment element assumed (lane / 2, as the softmax's lanes hold rows) instead of read
    "a layout assumed for the rescale": (
        "for (int e = 0; e < out[n].num_elements; ++e) out[n].x[e] *= row_factor[warp][static_cast<int>(rows.x[e])];\n"
        "#pragma unroll 1",
        "for (int e = 0; e < out[n].num_elements; ++e) out[n].x[e] *= row_factor[warp][row];\n"
        "#pragma unroll 1"),
    "output not rescaled by the new running max": (
        "for (int e = 0; e < out[n].num_elements; ++e) out[n].x[e] *= row_factor[warp][static_cast<int>(rows.x[e])];\n"
        "#pragma unroll 1", "#pragma unroll 1"),
    "barrier after the scores removed": ("__syncthreads();  // the scores are written; K is no longer read", ""),
    "mask off by one": ("const float s = k0 + c <= i && k0 + c < key_end ? scale * scores.s[warp][row][c] : negative_infinity();\n"
                        "            const float p",
                        "const float s = k0 + c <= i + 1 && k0 + c < key_end ? scale * scores.s[warp][row][c] : negative_infinity();\n"
                        "            const float p"),
}


@pytest.mark.skipif(not hasattr(cudaemu, "Module"), reason="the harness")
@pytest.mark.parametrize("mutation", MUTATIONS)
def test_each_mutation_fails_the_check(mutation):
    old, new = MUTATIONS[mutation]
    code = loader.kernel_source("attention")
    assert code.count(old) == 1, f"the mutation's target is not one place in the kernel: {old!r}"
    with pytest.raises((AssertionError, cudaemu.KernelError)):
        # T = 130: the second query tile's rows meet two full key tiles, and many take a new maximum in the second
        check_forward(1, 130, 2, 1, 128, code=code.replace(old, new))
