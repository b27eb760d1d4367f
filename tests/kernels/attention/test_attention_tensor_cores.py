"""The tensor-core forward and backward of the fused attention (kernels/attention.cu,
attention_forward_tc_bf16, attention_backward_dq_tc_bf16, attention_backward_tc_bf16, and their
tc_hd64_ variants for head dims up to 64, whose tiles hold 64 dims instead of 128): compiled only
with -DBOOSTMPI_ATTENTION_WMMA, which the wrapper adds for bfloat16 on NVIDIA devices of compute
capability 8.0 or later (BOOSTMPI_ATTENTION_TENSOR_CORES: unset or auto = that default; 1 = the same,
a missing CUDA header an error; 0 = the FMA kernels). 64-lane devices keep the FMA kernels.

On the execution harness (its WMMA draws the fragment element map at random per launch, so a
kernel assuming a layout fails) against the model's NumPy attention: O within twice the error of a
float32 reference that rounds P and O to bfloat16, the log-sum-exp within 1e-5; dQ, dK and dV likewise
(and near the FMA passes'); NVRTC compiles the three for sm_80 and sm_90 (with CUDA's crt/ headers on
the include path) without spills and with two resident blocks per SM; the kernel text without the
option has no such entry point; mutations fail the checks; a bfloat16 training step equals the CPU path.
"""

import functools
from pathlib import Path

import numpy as np
import pytest

from testing import cudaemu
from tests.support import gpu_compilers
from boostmpi.gpu import kernels as loader
from boostmpi.gpu import launch_plan
from tests.kernels.attention.test_attention_kernel import (BF16, F32_TOLERANCE, SLOW_SHAPES, _inputs, max_error, rounded_reference,
                                   specification)
from tests.emulators.cudaemu.test_cudaemu_wmma import crt_wheel_include
from tests.kernels.test_kernel_resources import MIN_RESIDENT_BLOCKS, nvidia_resident_blocks

pytestmark = pytest.mark.gpu

ENTRY = "attention_forward_tc_bf16"
BACKWARD = "attention_backward_tc_bf16"
DQ = "attention_backward_dq_tc_bf16"
ENTRIES_HD64 = [name.replace("_tc_", "_tc_hd64_") for name in (ENTRY, DQ, BACKWARD)]


def _entry(kernel, Dh):
    """The tensor-core entry point the wrapper launches for `kernel` at head dim Dh."""
    return loader.attention_entry(kernel, Dh, "bf16")


def _module(code, wmma=True):
    """attention.cu's text on the harness at 32 lanes with the loader's options for the current plan
    (launch_plan.ATTENTION): the tensor-core kernels with `wmma`, else the FMA ones only."""
    return _compiled(code, loader.compile_options("attention", 32, wmma))


@functools.lru_cache(maxsize=None)
def _compiled(code, options):
    return cudaemu.Module(code, options)


def check_forward(B, T, H, Hkv, Dh, code=None):
    q, k, v, do = _inputs(B, T, H, Hkv, Dh, BF16)
    o = cudaemu.DeviceArray(shape=q.shape, dtype=BF16)
    lse = cudaemu.DeviceArray(shape=(B, H, T), dtype=np.float32)
    grid = B * H * -(-T // launch_plan.ATTENTION.query_tile)
    _module(code or loader.kernel_source("attention")).get_function(_entry("attention_forward_tc", Dh))(
        (grid,), (launch_plan.ATTENTION.tc_threads,), (cudaemu.DeviceArray(q), cudaemu.DeviceArray(k), cudaemu.DeviceArray(v), o, lse,
                              *loader._attention_scalars(T, H, Hkv, Dh)))
    want_o, want_lse = specification(q, k, v, do)[:2]
    assert max_error(lse.get(), want_lse) <= F32_TOLERANCE * max(float(np.max(np.abs(want_lse))), 1.0), "lse"
    reference = rounded_reference(q, k, v, do)[0]
    assert max_error(o.get(), want_o) <= 2 * max_error(reference, want_o) + 1e-30, \
        f"o: kernel error {max_error(o.get(), want_o):.3g}, rounded reference {max_error(reference, want_o):.3g}"


# T = 1, T below and not a multiple of the tiles (a second query tile meets two key tiles), GQA, Dh 64
# and 48 (the hd64 entry points) and 96 and 128
@pytest.mark.parametrize("shape", [(1, 1, 2, 1, 64), (1, 70, 4, 2, 128), (2, 37, 2, 2, 96), (1, 70, 4, 2, 48)],
                         ids=lambda s: "B{}_T{}_H{}_Hkv{}_Dh{}".format(*s))
def test_tensor_core_forward_matches_the_model(shape):
    check_forward(*shape)


def test_the_option_is_off_by_default():
    default = _module(loader.kernel_source("attention"), wmma=False)
    assert ENTRY not in default.entry_points and ENTRY in _module(loader.kernel_source("attention")).entry_points


def test_nvrtc_compiles_it_within_the_budget():
    gpu_compilers.require("NVRTC")
    options = loader.compile_options("attention", 32, wmma=True) + (crt_wheel_include(),)
    reports = gpu_compilers.nvrtc([(loader.kernel_source("attention"), options, arch) for arch in ("80", "90", "100")])
    for report in reports:
        assert report["ok"], report["log"][-4000:]
        table = gpu_compilers.ptxas_table(report["log"])
        assert {ENTRY, BACKWARD, DQ, *ENTRIES_HD64} <= {entry for entry, _ in table}, sorted(table)
        for (entry, arch), info in table.items():
            if entry not in (ENTRY, BACKWARD, DQ, *ENTRIES_HD64):
                continue
            assert info["spills"] == 0 and info["stack"] == 0, (arch, info)
            blocks = nvidia_resident_blocks(arch, info["registers"], launch_plan.ATTENTION.tc_threads, info["smem"])
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
    "running sum not rescaled": ("running_sum = rescale * running_sum + tile_sum;", "running_sum = running_sum + tile_sum;"),
    "barrier after the scores removed": ("__syncthreads();  // the scores are written; K is no longer read", ""),
    "mask off by one": ("const float s = k0 + c <= i && k0 + c < key_end ? scale * scores.s[warp][row][c] : negative_infinity();\n"
                        "            const float p",
                        "const float s = k0 + c <= i + 1 && k0 + c < key_end ? scale * scores.s[warp][row][c] : negative_infinity();\n"
                        "            const float p"),
}


@pytest.mark.parametrize("mutation", MUTATIONS)
def test_each_mutation_fails_the_check(mutation):
    old, new = MUTATIONS[mutation]
    code = loader.kernel_source("attention")
    assert code.count(old) == 1, f"the mutation's target is not one place in the kernel: {old!r}"
    with pytest.raises((AssertionError, cudaemu.KernelError)):
        # T = 130: the second query tile's rows meet two full key tiles, and many take a new maximum in the second;
        # head dim 64: the tc_hd64_ instances of the same templates (HD = 64), the cheaper ones to emulate
        check_forward(1, 130, 1, 1, 64, code=code.replace(old, new))


# ---------------------------------------------------------------------------- the dK/dV pass


# At T = 1, dS = P (dP - delta) is 0 but for float32 rounding of dP - delta (the reference's is exactly 0)
ROUNDING_FLOOR = 1e-6


def _backward_inputs(B, T, H, Hkv, Dh):
    """bf16 q, k, v, dO; the exact lse and delta = rowsum(dO * O) of O rounded to bf16 (float32), which the
    forward and the dQ pass hand the dK/dV pass; the specification's dk, dv and the rounded reference's."""
    q, k, v, do = _inputs(B, T, H, Hkv, Dh, BF16)
    _, want_lse, _, want_dk, want_dv = specification(q, k, v, do)
    o, _, ref_dk, ref_dv = rounded_reference(q, k, v, do)
    delta = np.einsum("bthd,bthd->bht", np.asarray(do, np.float32), o).astype(np.float32)
    return (q, k, v, do, want_lse.astype(np.float32), delta), (want_dk, want_dv), (ref_dk, ref_dv)


def run_dkdv(entry, threads, key_tile, inputs, code=None, wmma=True):
    q, k, v, do, lse, delta = inputs
    B, T, H, Dh = q.shape
    Hkv = k.shape[2]
    dk, dv = (cudaemu.DeviceArray(shape=k.shape, dtype=BF16) for _ in range(2))
    module = _module(code or loader.kernel_source("attention"), wmma)
    module.get_function(entry)((B * Hkv * -(-T // key_tile),), (threads,),
                               (*(cudaemu.DeviceArray(a) for a in (q, k, v, do, lse, delta)), dk, dv,
                                *loader._attention_scalars(T, H, Hkv, Dh)))
    return dk.get(), dv.get()


def check_backward(B, T, H, Hkv, Dh, code=None):
    """dK, dV of the WMMA pass against the model's within twice the rounded reference's error, and
    against the FMA pass (attention_backward_bf16, same inputs) within the sum of both bounds."""
    inputs, want, reference = _backward_inputs(B, T, H, Hkv, Dh)
    plan = launch_plan.ATTENTION
    got = run_dkdv(_entry("attention_backward_tc", Dh), plan.tc_threads, plan.tc_bwd_keys, inputs, code)
    bounds = [2 * max_error(r, w) + ROUNDING_FLOOR for w, r in zip(want, reference)]
    for name, g, w, bound in zip(("dk", "dv"), got, want, bounds):
        assert max_error(g, w) <= bound, f"{name}: kernel error {max_error(g, w):.3g}, bound {bound:.3g}"
    # the FMA pass only once the model's check has passed (a mutant fails above without running it)
    fma = run_dkdv(_entry("attention_backward", Dh), plan.threads, plan.bwd_key_tile, inputs, wmma=False)
    for name, g, f, bound in zip(("dk", "dv"), got, fma, bounds):
        apart = max_error(g, f.astype(np.float64))
        assert apart <= 2 * bound, f"{name}: {apart:.3g} from the FMA pass, bound {2 * bound:.3g}"



# ---------------------------------------------------------------------------- the dQ pass


def run_dq(entry, threads, inputs, o, code=None, wmma=True):
    q, k, v, do, lse, _ = inputs
    B, T, H, Dh = q.shape
    dq = cudaemu.DeviceArray(shape=q.shape, dtype=BF16)
    delta = cudaemu.DeviceArray(shape=(B, H, T), dtype=np.float32)
    module = _module(code or loader.kernel_source("attention"), wmma)
    module.get_function(entry)((B * H * -(-T // launch_plan.ATTENTION.query_tile),), (threads,),
                               (*(cudaemu.DeviceArray(a) for a in (q, k, v, o, do, lse)), delta, dq,
                                *loader._attention_scalars(T, H, k.shape[2], Dh)))
    return dq.get(), delta.get()


def check_dq(B, T, H, Hkv, Dh, code=None):
    """dQ of the WMMA pass against the model's within twice the rounded reference's error and near the
    FMA pass's (same inputs); delta = rowsum(dO * O) within 1e-5 of float32's."""
    inputs, _, _ = _backward_inputs(B, T, H, Hkv, Dh)
    q, k, v, do, lse, want_delta = inputs
    want_dq = specification(q, k, v, do)[2]
    o, reference = rounded_reference(q, k, v, do)[:2]
    o = o.astype(BF16)
    got, delta = run_dq(_entry("attention_backward_dq_tc", Dh), launch_plan.ATTENTION.tc_threads, inputs, o, code)
    assert max_error(delta, want_delta) <= F32_TOLERANCE * max(float(np.max(np.abs(want_delta))), 1.0), "delta"
    bound = 2 * max_error(reference, want_dq) + ROUNDING_FLOOR
    assert max_error(got, want_dq) <= bound, f"dq: kernel error {max_error(got, want_dq):.3g}, bound {bound:.3g}"
    fma = run_dq(_entry("attention_backward_dq", Dh), launch_plan.ATTENTION.threads, inputs, o, wmma=False)[0]
    apart = max_error(got, fma.astype(np.float64))
    assert apart <= 2 * bound, f"dq: {apart:.3g} from the FMA pass, bound {2 * bound:.3g}"


# T = 1; T not a multiple of the tiles (a second key tile, partly past T); GQA 2 and 4 query heads per KV
# head; Dh 64 and 48 (the hd64 entry points), 96 and 128
@pytest.mark.parametrize("shape", [(1, 1, 2, 1, 64), (1, 70, 4, 2, 128), (2, 37, 4, 1, 96), (1, 70, 4, 2, 48)],
                         ids=lambda s: "B{}_T{}_H{}_Hkv{}_Dh{}".format(*s))
@pytest.mark.parametrize("check", [check_backward, check_dq], ids=["dkdv", "dq"])
def test_tensor_core_backward_matches_the_model_and_the_fma_passes(check, shape):
    check(*shape)


# The fuller matrix: GQA 8 query heads per KV head, T past two tiles, odd head dims
@pytest.mark.slow
@pytest.mark.parametrize("shape", SLOW_SHAPES, ids=lambda s: "B{}_T{}_H{}_Hkv{}_Dh{}".format(*s))
@pytest.mark.parametrize("check", [check_backward, check_dq], ids=["dkdv", "dq"])
def test_tensor_core_backward_matches_the_model_full(check, shape):
    check(*shape)


BACKWARD_MUTATIONS = {
    # Q (and dO) loaded as they are, not transposed, for S^T = K Q^T and dP^T = V dO^T
    "dkdv: a wrong transpose": (check_backward, "__nv_bfloat16, wmma::col_major> b_frag;",
                                "__nv_bfloat16, wmma::row_major> b_frag;"),
    "dkdv: causal mask missing": (check_backward, "p[m] = j <= i && i < tokens ?", "p[m] = i < tokens ?"),
    "dkdv: delta not subtracted": (check_backward, "p[m] * (t.s[warp][key][c] - t.delta[c])", "p[m] * t.s[warp][key][c]"),
    "dkdv: barrier after P^T removed": (check_backward, "__syncthreads();  // P^T is written", ""),
    "dkdv: dK not scaled": (check_backward, "const float factor = n < DIM_TILES ? scale : 1.0f;", "const float factor = 1.0f;"),
    # K (and V) loaded as they are, not transposed, for S = Q K^T and dP = dO V^T
    "dq: a wrong transpose": (check_dq, "__nv_bfloat16, wmma::col_major> b;", "__nv_bfloat16, wmma::row_major> b;"),
    "dq: causal mask missing": (check_dq, "p[r] = j <= i && i < tokens ?", "p[r] = i < tokens ?"),
    "dq: delta not subtracted": (check_dq, "p[r] * (t.s[warp][r][lane] - t.delta[warp][r])", "p[r] * t.s[warp][r][lane]"),
    "dq: barrier after dS removed": (check_dq, "__syncthreads();  // dS is written", ""),
    "dq: key tile's first key ignored": (check_dq, "const int i = q0 + 16 * warp + r, j = k0 + lane;",
                                         "const int i = q0 + 16 * warp + r, j = lane;"),
}


@pytest.mark.parametrize("mutation", BACKWARD_MUTATIONS)
def test_each_backward_mutation_fails_the_check(mutation):
    check, old, new = BACKWARD_MUTATIONS[mutation]
    code = loader.kernel_source("attention")
    assert code.count(old) == 1, f"the mutation's target is not one place in the kernel: {old!r}"
    with pytest.raises((AssertionError, cudaemu.KernelError)):
        # two key tiles, 2 query heads per KV head; head dim 64: the tc_hd64_ instances of the same templates
        check(1, 70, 2, 1, 64, code=code.replace(old, new))


# ---------------------------------------------------------------------------- the wrapper's option


def _wrapper_forward(monkeypatch, warp, B=1, T=70, H=2, Hkv=1, Dh=128, setting="1", major=8):
    """kernels.attention_forward with BOOSTMPI_ATTENTION_TENSOR_CORES=`setting` (None: unset) on a device
    of `warp` lanes and compute capability `major`: (launched entry points, o, lse) and the inputs. Two
    query tiles and 2 query heads per KV head by default (more KV heads: check_forward and check_backward)."""
    import cupy

    from tests.support.gpu_setup import GPU

    if not GPU.standin:
        pytest.skip("the harness runs the option here; a GPU runs its own warp width")
    real = loader._device_info
    monkeypatch.setattr(loader, "_device_info",
                        lambda device_id: real(device_id)._replace(warp_size=warp, nvidia_major=major))
    monkeypatch.setattr(loader, "_module", functools.lru_cache(maxsize=None)(loader._module.__wrapped__))
    if setting is None:
        monkeypatch.delenv(loader.ATTENTION_TENSOR_CORES_ENV, raising=False)
    else:
        monkeypatch.setenv(loader.ATTENTION_TENSOR_CORES_ENV, setting)
    launched = []
    launch = loader._launch
    monkeypatch.setattr(loader, "_launch", lambda kernel, *a, **k: (launched.append(kernel.name), launch(kernel, *a, **k)))
    inputs = _inputs(B, T, H, Hkv, Dh, BF16)
    o, lse = loader.attention_forward(*(cupy.asarray(a) for a in inputs[:3]))
    return launched, cupy.asnumpy(o), cupy.asnumpy(lse), inputs


def test_the_option_runs_the_tensor_core_forward_through_the_wrapper(monkeypatch):
    launched, o, lse, (q, k, v, do) = _wrapper_forward(monkeypatch, 32)
    assert launched == [ENTRY]
    want_o, want_lse = specification(q, k, v, do)[:2]
    assert max_error(lse, want_lse) <= F32_TOLERANCE * max(float(np.max(np.abs(want_lse))), 1.0)
    assert max_error(o, want_o) <= 2 * max_error(rounded_reference(q, k, v, do)[0], want_o)


def _wrapper_backward(o, lse, inputs):
    import cupy

    q, k, v, do = inputs
    grads = loader.attention_backward(*(cupy.asarray(a) for a in (do, q, k, v, o)), cupy.asarray(lse))
    return [cupy.asnumpy(g) for g in grads]


def test_the_option_runs_the_tensor_core_backward_through_the_wrapper(monkeypatch):
    """Forward and backward through the wrapper: the dK/dV pass reads the delta the dQ pass wrote."""
    launched, o, lse, inputs = _wrapper_forward(monkeypatch, 32)
    grads = _wrapper_backward(o, lse, inputs)
    assert launched == [ENTRY, DQ, BACKWARD]
    want, reference = specification(*inputs)[2:], rounded_reference(*inputs)[1:]
    for name, got, w, r in zip(("dq", "dk", "dv"), grads, want, reference):
        assert max_error(got, w) <= 2 * max_error(r, w) + ROUNDING_FLOOR, name


def test_head_dims_up_to_64_run_the_hd64_tensor_core_entry_points(monkeypatch):
    """Dh 48 through the wrapper: the three tc_hd64_ entry points, forward and backward within the bounds."""
    launched, o, lse, inputs = _wrapper_forward(monkeypatch, 32, Dh=48)
    grads = _wrapper_backward(o, lse, inputs)
    assert launched == ENTRIES_HD64
    want_o = specification(*inputs)[0]
    assert max_error(o, want_o) <= 2 * max_error(rounded_reference(*inputs)[0], want_o)
    want, reference = specification(*inputs)[2:], rounded_reference(*inputs)[1:]
    for name, got, w, r in zip(("dq", "dk", "dv"), grads, want, reference):
        assert max_error(got, w) <= 2 * max_error(r, w) + ROUNDING_FLOOR, name


def test_the_option_leaves_64_lane_devices_on_the_fma_kernels(monkeypatch):
    launched, o, lse, inputs = _wrapper_forward(monkeypatch, 64, T=5)
    _wrapper_backward(o, lse, inputs)
    assert launched == FMA_ENTRIES


FMA_ENTRIES = ["attention_forward_bf16", "attention_backward_dq_bf16", "attention_backward_bf16"]


@pytest.mark.parametrize("setting,major,tensor_cores", [(None, 8, True), ("auto", 9, True), ("0", 8, False),
                                                        (None, 7, False), (None, 0, False)],
                         ids=["unset-sm80", "auto-sm90", "off-sm80", "unset-sm70", "unset-amd"])
def test_tensor_cores_are_the_default_on_sm80_and_later(monkeypatch, setting, major, tensor_cores):
    launched, o, lse, inputs = _wrapper_forward(monkeypatch, 32, T=5, setting=setting, major=major)
    _wrapper_backward(o, lse, inputs)
    assert launched == ([ENTRY, DQ, BACKWARD] if tensor_cores else FMA_ENTRIES)


def test_without_cudas_mma_header_auto_says_so_once_and_1_is_refused(monkeypatch, capsys):
    """No crt/mma.h: the default falls back to the FMA kernels with one line on standard error (once a
    process); =1 is a problem start-up reports (exit 2 there), and so is a value that is not 1, 0 or auto."""
    from boostmpi.gpu import tensor_cores

    monkeypatch.setattr(tensor_cores, "mma_include", lambda: None)
    tensor_cores._say_once.cache_clear()
    for _ in range(2):
        launched, o, lse, inputs = _wrapper_forward(monkeypatch, 32, T=5, setting=None)
        _wrapper_backward(o, lse, inputs)
        assert launched == FMA_ENTRIES
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "crt/mma.h was not found" in err[0] and "FMA kernels" in err[0], err
    assert loader.attention_tensor_cores_problem("bf16") is None
    monkeypatch.setenv(loader.ATTENTION_TENSOR_CORES_ENV, "1")
    assert "crt/mma.h was not found" in loader.attention_tensor_cores_problem("bf16")
    assert loader.attention_tensor_cores_problem("f32") is None  # float32 never asks for the header
    monkeypatch.setenv(loader.ATTENTION_TENSOR_CORES_ENV, "yes")
    assert loader.attention_tensor_cores_problem("f32") == \
        "BOOSTMPI_ATTENTION_TENSOR_CORES='yes': use 1 (tensor cores), 0 (FMA kernels) or auto"


# cola in the default run (the attention is the same in every arch); svd and full with the slow tests
@pytest.mark.parametrize("arch", ["cola", pytest.param("svd", marks=pytest.mark.slow), pytest.param("full", marks=pytest.mark.slow)])
def test_a_bf16_training_step_with_the_option_equals_the_cpu_path(monkeypatch, arch):
    """One bfloat16 training step (tests/support/gpu_steps.py: GQA, head dim 16) with the option on: the forward
    of every layer and both backward passes on the WMMA kernels of 64-dim tiles (asserted from the launches), the loss and gradients within
    the bfloat16 tolerance of the float64 CPU step (tests/integration/gpu/test_gpu.py's)."""
    from tests.support.gpu_setup import GPU
    from tests.support.gpu_steps import step
    from tests.integration.gpu.test_gpu import assert_step_close, cpu_step

    if not GPU.standin:
        pytest.skip("the harness's 32-lane device; a GPU runs its own warp width")
    monkeypatch.setattr(loader, "_module", functools.lru_cache(maxsize=None)(loader._module.__wrapped__))
    monkeypatch.setenv(loader.ATTENTION_TENSOR_CORES_ENV, "1")
    launched = []
    launch = loader._launch
    monkeypatch.setattr(loader, "_launch", lambda kernel, *a, **k: (launched.append(kernel.name), launch(kernel, *a, **k)))
    got = step(arch, "gpu", "bfloat16")
    assert set(ENTRIES_HD64) <= set(launched), sorted(set(launched))  # head dim 16: the tiles of 64 dims
    assert not {"attention_forward_hd64_bf16", "attention_backward_hd64_bf16", "attention_backward_dq_hd64_bf16"} \
        & set(launched), sorted(set(launched))
    assert_step_close(got, cpu_step(arch), "bfloat16", f"{arch} bfloat16 with tensor cores")


@pytest.mark.parametrize("value,header,fragment", [
    ("yes", True, "BOOSTMPI_ATTENTION_TENSOR_CORES='yes': use 1 (tensor cores), 0 (FMA kernels) or auto"),
    ("1", False, "BOOSTMPI_ATTENTION_TENSOR_CORES=1: CUDA's crt/mma.h was not found"),
])
def test_start_up_refuses_a_setting_it_cannot_honour_in_one_line(monkeypatch, tmp_path, capfd, value, header, fragment):
    """Before any weight is drawn: exit 2, one line, nothing written."""
    from tests.support.gpu_setup import GPU
    from tests.support.train_helpers import assert_refused, train_argv, write_text_shards

    from boostmpi.gpu import tensor_cores

    if not GPU.standin:
        pytest.skip("the stand-in's A100 (compute capability 8.0); a GPU has its own")
    if not header:
        monkeypatch.setattr(tensor_cores, "mma_include", lambda: None)
    monkeypatch.setenv(loader.ATTENTION_TENSOR_CORES_ENV, value)
    shards = write_text_shards(tmp_path / "text", max_bytes=60_000)
    assert_refused(capfd, train_argv(tmp_path / "run", *shards, "train.device=gpu", "train.dtype=bfloat16"),
                   tmp_path, fragment)


def test_tp2_bf16_steps_on_the_tensor_cores_equal_one_rank(tmp_path, slow_run):
    """Tensor parallelism 2 (heads split across the ranks), bfloat16, the tensor-core kernels (the default
    on the stand-in's A100): each rank's attention on its own heads, and the step equal to the one-rank
    step on the tensor-core kernels within the bfloat16 tolerance. cola in the default run (the head split
    is the same in every arch; each arch's TP step is held to one rank in test_gpu), every arch with the
    slow tests."""
    import os
    import subprocess
    import sys

    from tests.support.gpu_setup import GPU
    from tests.support.gpu_steps import ARCHS, step
    from tests.support.mpi_helpers import MPIEXEC
    from tests.integration.gpu.test_gpu import assert_step_close

    if not GPU.standin:
        pytest.skip("the harness's 32-lane device; a GPU runs its own warp width")
    out = tmp_path / "tp2.npz"
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", BOOSTMPI_ATTENTION_TENSOR_CORES="1")
    proc = subprocess.run(["timeout", "600", MPIEXEC, "-n", "2", sys.executable, str(Path(__file__).resolve().parents[2] / "support" / "gpu_steps.py"),
                           str(out), "tp2", "bfloat16", "", "" if slow_run else "tp2/cola"],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with np.load(out) as data:
        results = {k: data[k] for k in data.files}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(loader.ATTENTION_TENSOR_CORES_ENV, "1")
        mp.setattr(loader, "_module", functools.lru_cache(maxsize=None)(loader._module.__wrapped__))
        for arch in ARCHS if slow_run else ("cola",):
            prefix = f"tp2/{arch}/bfloat16/"
            grads = {k[len(prefix) + 5:]: v for k, v in results.items() if k.startswith(prefix + "grad/")}
            assert grads, sorted(results)[:5]
            assert_step_close((float(results[prefix + "loss"]), grads), step(arch, "gpu", "bfloat16"), "bfloat16", prefix)


def test_the_header_is_found_without_any_nvidia_wheel(monkeypatch, tmp_path):
    """A centre's venv has no nvidia.* package at all (CUDA comes from its module): the search goes
    on to $CUDA_PATH, $CUDA_HOME and the nvcc on PATH instead of failing on the missing package."""
    import importlib.util

    from boostmpi.gpu import tensor_cores

    real = importlib.util.find_spec

    def no_nvidia(name, *args):
        if name.startswith("nvidia"):
            raise ModuleNotFoundError(f"No module named {name.split('.')[0]!r}")
        return real(name, *args)

    toolkit = tmp_path / "cuda"
    (toolkit / "include" / "crt").mkdir(parents=True)
    (toolkit / "include" / "crt" / "mma.h").write_text("")
    monkeypatch.setattr(tensor_cores.importlib.util, "find_spec", no_nvidia)
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    for variable in ("CUDA_PATH", "CUDA_HOME"):
        monkeypatch.delenv("CUDA_PATH", raising=False)
        monkeypatch.delenv("CUDA_HOME", raising=False)
        tensor_cores.mma_include.cache_clear()
        assert tensor_cores.mma_include() is None
        monkeypatch.setenv(variable, str(toolkit))
        tensor_cores.mma_include.cache_clear()
        assert tensor_cores.mma_include() == f"-I{toolkit / 'include'}"
    tensor_cores.mma_include.cache_clear()
