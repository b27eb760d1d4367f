"""The fused attention kernels (kernels/attention.cu) against the model's NumPy attention.

The NumPy attention of boostmpi/model/layers.py, run in float64 on the kernel's own inputs, is the
one specification. float32: within 1e-5 of the largest reference value. bfloat16: the kernel's
largest error at most twice that of a float32 NumPy reference which rounds the same intermediates
(the probabilities, dS and the outputs) to bfloat16. Causal edge cases: T = 1, T below one tile,
T not a multiple of the tiles, 1/2/4 query heads per key/value head, head dims 64 and 128 (and an
odd one), on 32- and 64-lane execution. On a real GPU when CuPy reaches one, else on the CuPy
stand-in, whose launches run the kernel text on the CUDA execution harness (testing/cudaemu).
Registers, shared memory, spills and resident blocks under NVRTC and hipRTC are checked with every
other kernel's in tests/kernels/test_kernel_resources.py.
"""

import dataclasses
import functools

import numpy as np
import pytest

from boostmpi.backend import to_numpy
from tests.support.gpu_setup import GPU
from boostmpi.gpu import kernels, launch_plan, tensor_cores
from boostmpi.model import layers

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)
F32_TOLERANCE = 1e-5


@pytest.fixture(params=[32, 64], ids=["warp32", "warp64"])
def lanes(request, monkeypatch):
    """The device's warp width as the loader sees it (64: an AMD CDNA wavefront, so the kernels
    are compiled with -DWARP_SIZE=64 and run 64 lanes wide on the harness). On a real GPU only
    the device's own width runs."""
    if not GPU.standin and request.param != kernels._current_device().warp_size:
        pytest.skip(f"the device's warp is {kernels._current_device().warp_size} wide")
    real = kernels._device_info
    monkeypatch.setattr(kernels, "_device_info", lambda device_id: real(device_id)._replace(warp_size=request.param))
    monkeypatch.setattr(kernels, "_module", functools.lru_cache(maxsize=None)(kernels._module.__wrapped__))
    return request.param


def _inputs(B, T, H, Hkv, Dh, dtype, seed=3):
    rng = np.random.default_rng(seed)
    q, do = (rng.standard_normal((B, T, H, Dh)).astype(dtype) for _ in range(2))
    k, v = (rng.standard_normal((B, T, Hkv, Dh)).astype(dtype) for _ in range(2))
    # scores that grow with the key's position: a later key tile raises a row's running maximum,
    # so the online softmax's rescaling is exercised (random scores peak early as often as late)
    q[..., 0] = np.abs(q[..., 0]) + 2
    k[..., 0] += (6 * np.arange(T) / max(T, 1)).astype(dtype)[None, :, None]
    return q, k, v, do


def specification(q, k, v, do):
    """(o, lse, dq, dk, dv) of the model's NumPy attention in float64."""
    q, k, v, do = (np.asarray(a, np.float64) for a in (q, k, v, do))
    B, T, H, Dh = q.shape
    o, cache = layers.attention_forward(q, k, v)
    lse = (cache.row_max + np.log(cache.row_sum)).reshape(B, H, T)
    dq, dk, dv = layers.attention_backward(do.reshape(B, T, H * Dh), cache)
    return o.reshape(q.shape), lse, dq, dk, dv


def rounded_reference(q, k, v, do):
    """(o, dq, dk, dv): float32 arithmetic that rounds P, dS and the outputs to bfloat16."""
    q, k, v, do = (np.asarray(a, np.float32) for a in (q, k, v, do))
    B, T, H, Dh = q.shape
    G = H // k.shape[2]
    kr, vr = np.repeat(k, G, axis=2), np.repeat(v, G, axis=2)

    def bf(a):
        return a.astype(BF16).astype(np.float32)

    qh, kh, vh, doh = (a.transpose(0, 2, 1, 3) for a in (q, kr, vr, do))  # [B, H, T, Dh]
    s = qh @ kh.transpose(0, 1, 3, 2) / np.float32(np.sqrt(Dh))
    s[..., np.triu(np.ones((T, T), bool), k=1)] = -np.inf
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p = bf(p / p.sum(axis=-1, keepdims=True))
    o = bf(p @ vh)
    delta = (doh * o).sum(axis=-1, keepdims=True)
    ds = bf(p * (doh @ vh.transpose(0, 1, 3, 2) - delta))
    scale = np.float32(1 / np.sqrt(Dh))
    dq = bf(ds @ kh * scale)
    dk = (ds.transpose(0, 1, 3, 2) @ qh * scale).reshape(B, -1, G, T, Dh).sum(axis=2)
    dv = (p.transpose(0, 1, 3, 2) @ doh).reshape(B, -1, G, T, Dh).sum(axis=2)
    token_major = lambda a: a.transpose(0, 2, 1, 3)  # noqa: E731
    return token_major(o), token_major(dq), token_major(bf(dk)), token_major(bf(dv))


def run_kernels(q, k, v, do):
    import cupy

    dq_, dk_, dv_, do_ = (cupy.asarray(a) for a in (q, k, v, do))
    o, lse = kernels.attention_forward(dq_, dk_, dv_)
    dq, dk, dv = kernels.attention_backward(do_, dq_, dk_, dv_, o, lse)
    return [to_numpy(a) for a in (o, lse, dq, dk, dv)]


def max_error(got, want):
    return float(np.max(np.abs(np.asarray(got, np.float64) - want), initial=0.0))


def check_against_specification(B, T, H, Hkv, Dh, dtype):
    q, k, v, do = _inputs(B, T, H, Hkv, Dh, dtype)
    got = run_kernels(q, k, v, do)
    want = specification(q, k, v, do)
    names = ("o", "lse", "dq", "dk", "dv")
    for name, g, w in zip(names, got, want):
        assert g.shape == w.shape, (name, g.shape, w.shape)
        assert g.dtype == (np.float32 if name == "lse" else dtype), (name, g.dtype)
        assert np.isfinite(np.asarray(g, np.float32)).all(), name
    if dtype == np.float32:
        for name, g, w in zip(names, got, want):
            scale = max(float(np.max(np.abs(w))), 1.0)
            assert max_error(g, w) <= F32_TOLERANCE * scale, f"{name}: {max_error(g, w) / scale:.3g} relative"
    else:
        assert max_error(got[1], want[1]) <= F32_TOLERANCE * max(float(np.max(np.abs(want[1]))), 1.0), "lse"
        for name, g, r, w in zip(("o", "dq", "dk", "dv"), [got[0], *got[2:]], rounded_reference(q, k, v, do),
                                 [want[0], *want[2:]]):
            # at T = 1 the rounded reference is exact (o = v); tensor cores' products still differ by ~1e-7
            assert max_error(g, w) <= 2 * max_error(r, w) + (1e-6 if T == 1 else 1e-30), \
                f"{name}: kernel error {max_error(g, w):.3g}, rounded reference {max_error(r, w):.3g}"


# (B, T, H, Hkv, Dh): T below one tile, T not a multiple of the tiles, groups of 1/2/4 query heads
CI_SHAPES = [
    (1, 1, 2, 1, 64),
    (1, 37, 4, 1, 64),
    (2, 70, 4, 2, 64),
    (1, 33, 2, 2, 128),
]
SLOW_SHAPES = [(1, 130, 8, 1, 128), (1, 65, 8, 2, 128), (2, 100, 2, 2, 40), (1, 129, 4, 4, 64)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", CI_SHAPES, ids=lambda s: "B{}_T{}_H{}_Hkv{}_Dh{}".format(*s))
def test_attention_kernels_match_the_model(monkeypatch, attention_gpu_default, slow_run, lanes, shape, dtype):
    """With the real-GPU default (attention_gpu_default): the entry points launched are those
    tensor_cores.use_wmma chooses for this device and dtype (the `_tc` ones for bfloat16 on tensor cores).
    Unless the slow tests run, the default is taken at T = 37 only and the other shapes run the FMA
    kernels (the tensor-core kernels' own shape matrix is test_attention_tensor_cores.py's)."""
    if not slow_run and shape != (1, 37, 4, 1, 64):
        monkeypatch.setenv(kernels.ATTENTION_TENSOR_CORES_ENV, "0")
    launched = set()
    launch = kernels._launch
    monkeypatch.setattr(kernels, "_launch", lambda kernel, *a, **k: (launched.add(kernel.name), launch(kernel, *a, **k)))
    check_against_specification(*shape, dtype)
    suffix = "f32" if dtype == np.float32 else "bf16"
    tc = "tc_" if tensor_cores.use_wmma(suffix, kernels._current_device()) else ""  # the tensor-core entry points
    hd = "hd64_" if shape[4] <= 64 else ""  # head dims up to 64: the entry points whose tiles hold 64 dims
    want = {f"attention_forward_{tc}{hd}{suffix}", f"attention_backward_dq_{tc}{hd}{suffix}",
            f"attention_backward_{tc}{hd}{suffix}"}
    assert want <= launched, (sorted(want), sorted(launched))


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", SLOW_SHAPES, ids=lambda s: "B{}_T{}_H{}_Hkv{}_Dh{}".format(*s))
def test_attention_kernels_match_the_model_full(lanes, shape, dtype):
    check_against_specification(*shape, dtype)


# ---------------------------------------------------------------------------- mutations
# Each one-line change to the kernel text must fail the check above: on the harness a missing
# barrier is a reported race or a read of unwritten shared memory, the others wrong numbers.

BARRIER_AFTER_LOAD = "        __syncthreads();\n        for (int c0 = 0; c0 < n; c0 += CHUNK) {"
DQ_BARRIER_AFTER_LOAD = "        __syncthreads();\n        for (int jj = 0; jj < n; ++jj) {"
MUTATIONS = {
    "forward barrier after the tile load": (BARRIER_AFTER_LOAD, BARRIER_AFTER_LOAD.split("\n")[1]),
    "dQ barrier after the tile load": (DQ_BARRIER_AFTER_LOAD, DQ_BARRIER_AFTER_LOAD.split("\n")[1]),
    "forward barrier before the next tile": (
        "        __syncthreads();  // every row is done with the previous tile\n", ""),
    "dK/dV barrier after the query tile load": (
        "            __syncthreads();\n            for (int ii = 0;", "            for (int ii = 0;"),
    "output not rescaled by the new running max": (
        "for (int kk = 0; kk < DIMS; ++kk) acc[kk] *= rescale;", ""),
    "running sum not rescaled": ("running_sum = running_sum * rescale + tile_sum;",
                                 "running_sum = running_sum + tile_sum;"),
    "forward mask off by one": ("(c0 + jj < n && k0 + c0 + jj <= i)", "(c0 + jj < n && k0 + c0 + jj <= i + 1)"),
    "dQ mask off by one": ("k0 + jj <= i ? expf", "k0 + jj < i ? expf"),
    "dK/dV mask off by one": ("(live && j <= i0 + ii)", "(live && j < i0 + ii)"),
    "delta not subtracted in dK/dV": ("p * (dp - delta_tile[ii])", "p * dp"),
}


@pytest.fixture
def kernel_text(monkeypatch):
    """Replaces one line of kernels/attention.cu (or rope.cu) for the wrappers; returns the setter."""
    real = kernels.kernel_source

    def mutate(old, new):
        [file] = [name for name in ("attention", "rope") if old in real(name)]
        text = real(file)
        assert text.count(old) == 1, f"the mutation's target is not one place in the kernel: {old!r}"
        monkeypatch.setattr(kernels, "kernel_source", lambda name: text.replace(old, new) if name == file else real(name))
        monkeypatch.setattr(kernels, "_module", functools.lru_cache(maxsize=None)(kernels._module.__wrapped__))

    return mutate


@pytest.mark.gpu
@pytest.mark.skipif(not GPU.standin, reason="the harness reports races; a GPU need not show them")
@pytest.mark.parametrize("mutation", MUTATIONS)
def test_each_mutation_fails_the_check(kernel_text, mutation):
    from testing import cudaemu

    # T = 70: the second query tile stages two K/V tiles (64 keys of float32 at head dim 64)
    check = functools.partial(check_against_specification, 1, 70, 2, 1, 64, np.float32)
    kernel_text(*MUTATIONS[mutation])
    with pytest.raises((AssertionError, cudaemu.KernelError)):
        check()


# ---------------------------------------------------------------------------- the model's GPU path


def _relative_errors(got, want):
    (loss, grads), (ref_loss, ref_grads) = got, want
    errors = {"loss": abs(loss - ref_loss) / abs(ref_loss)}
    errors.update({name: float(np.abs(grads[name] - g).max() / (np.abs(g).max() + 1e-30)) for name, g in ref_grads.items()})
    return errors


@pytest.mark.gpu
# cola in the default run (the attention kernels are the same in every arch; test_gpu holds every arch and
# recompute mode to the CPU at 1e-4); the other archs and recompute modes with the slow tests
@pytest.mark.parametrize("arch,recompute", [("cola", "none")] + [pytest.param(*c, marks=pytest.mark.slow) for c in (
    ("svd", "none"), ("full", "none"), ("cola", "lowrank"), ("full", "layer"))])
def test_float32_training_step_through_the_fused_kernels_equals_the_cpu_path(monkeypatch, arch, recompute):
    """One training step (tests/support/gpu_steps.py: GQA, 2 query heads per key/value head) on the GPU path,
    whose attention is the fused kernels (asserted from the launches), against the CPU path in float32:
    the loss and every gradient within 1e-5 relative."""
    from tests.support.gpu_steps import step

    launched = []
    launch = kernels._launch
    monkeypatch.setattr(kernels, "_launch", lambda kernel, *a, **k: (launched.append(kernel.name), launch(kernel, *a, **k)))
    train = dict(recompute=recompute)
    errors = _relative_errors(step(arch, "gpu", "float32", train=train), step(arch, "cpu", "float32", train=train))
    # head dim 16: the entry points whose tiles hold 64 dims
    assert {"attention_forward_hd64_f32", "attention_backward_dq_hd64_f32", "attention_backward_hd64_f32"} <= set(launched)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= F32_TOLERANCE, f"{worst}: relative error {errors[worst]:.3g}"


# ---------------------------------------------------------------------------- the launch plan
# The tile sizes are written once, in boostmpi.gpu.launch_plan.ATTENTION: the loader compiles the kernels
# with them (-D options) and the wrappers launch with them. Changed there, kernels and wrappers change
# together and the results still match; sizes the kernels cannot work with do not compile.

# half the query and key tiles, and half the threads (4 lanes a query, 8 a key, as before)
SMALLER_TILES = {"query_tile": 32, "threads": 128, "bwd_key_tile": 16}


@pytest.mark.gpu
@pytest.mark.skipif(not GPU.standin, reason="the harness counts global bytes; a GPU does not")
def test_a_changed_plan_changes_the_kernels_and_the_wrappers_together(monkeypatch):
    from testing import cudaemu
    import cupy

    monkeypatch.setattr(launch_plan, "ATTENTION", dataclasses.replace(launch_plan.ATTENTION, **SMALLER_TILES))
    monkeypatch.setenv(kernels.ATTENTION_TENSOR_CORES_ENV, "0")  # the FMA kernels, whose tiles these are
    launches = []
    launch = kernels._launch
    monkeypatch.setattr(kernels, "_launch", lambda kernel, grid, block, *a, **k: (
        launches.append((kernel.name, grid, block)), launch(kernel, grid, block, *a, **k)))
    B, T, H, Hkv, Dh = 1, 70, 2, 1, 64
    check_against_specification(B, T, H, Hkv, Dh, np.float32)
    assert launches == [("attention_forward_hd64_f32", B * H * 3, 128), ("attention_backward_dq_hd64_f32", B * H * 3, 128),
                        ("attention_backward_hd64_f32", B * Hkv * 5, 128)]
    # the bytes the smaller tiles move are the plan's count for them (more than the default plan's)
    q, k, v, do = (cupy.asarray(a) for a in _inputs(B, T, H, Hkv, Dh, np.float32))
    cudaemu.global_bytes(reset=True)
    o, lse = kernels.attention_forward(q, k, v)
    forward = cudaemu.global_bytes(reset=True)
    kernels.attention_backward(do, q, k, v, o, lse)
    backward = cudaemu.global_bytes(reset=True)
    plan = kernels.attention_traffic(B, T, H, Hkv, Dh, 4)
    assert forward == plan["forward"]
    assert backward == tuple(a + b for a, b in zip(plan["backward_dq"], plan["backward_dkdv"]))
    assert forward[0] > launch_plan.AttentionPlan().traffic(B, T, H, Hkv, Dh, 4)["forward"][0]


@pytest.mark.gpu
@pytest.mark.parametrize("sizes,message", [
    ({"query_tile": 32}, "forward, dQ: one row group per query"),
    ({"bwd_key_tile": 64}, "dK/dV: one row group per key"),
    ({"score_chunk": 48}, "whole score chunks per staged tile"),
    ({"head_dim_small": 256}, "the hd64_ entry points' tiles hold fewer dims"),
    ({"tc_dq_keys": 16}, "Q stages through K and V"),
], ids=["query tile", "key tile", "score chunk", "small head dim", "tensor-core dQ keys"])
def test_a_plan_the_kernels_cannot_run_does_not_compile(monkeypatch, sizes, message):
    from testing import cudaemu

    monkeypatch.setattr(launch_plan, "ATTENTION", dataclasses.replace(launch_plan.ATTENTION, **sizes))
    wmma = any(name.startswith("tc_") for name in sizes)  # the tensor-core kernels' sizes: their variant
    with pytest.raises(cudaemu.CompileError, match=message):
        cudaemu.Module(kernels.kernel_source("attention"), kernels.compile_options("attention", 32, wmma))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["attention", "rmsnorm"])
def test_a_build_without_the_plan_stops(name):
    from testing import cudaemu

    with pytest.raises(cudaemu.CompileError, match="from the launch plan"):
        cudaemu.Module(kernels.kernel_source(name), kernels.COMPILE_OPTIONS + ("-DWARP_SIZE=32",))
    cudaemu.Module(kernels.kernel_source(name), kernels.compile_options(name, 32))


# ---------------------------------------------------------------------------- global traffic


@pytest.mark.gpu
@pytest.mark.skipif(not GPU.standin, reason="the execution harness counts global bytes; a GPU does not")
@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["f32", "bf16"])
def test_counted_global_bytes_are_the_tile_plans(dtype):
    check_traffic(dtype)


def check_traffic(dtype):
    """Every global access counted by the harness (no cache): each launch moves exactly the bytes
    its tile plan states (kernels.attention_traffic), and the forward's are FlashAttention-2's for
    64-query tiles: Q read once, K and V once per query tile up to its last query, O and lse written
    once. Nothing grows with T x T: the only buffers beside inputs and outputs are lse and delta."""
    from testing import cudaemu
    import cupy

    B, T, H, Hkv, Dh = 1, 100, 4, 2, 64
    q, k, v, do = (cupy.asarray(a) for a in _inputs(B, T, H, Hkv, Dh, dtype))
    plan = kernels.attention_traffic(B, T, H, Hkv, Dh, np.dtype(dtype).itemsize)
    counted = {}
    cudaemu.global_bytes(reset=True)
    o, lse = kernels.attention_forward(q, k, v)
    counted["forward"] = cudaemu.global_bytes(reset=True)
    delta = cupy.empty((B, H, T), dtype=np.float32)
    dq, dk, dv = cupy.empty_like(q), cupy.empty_like(k), cupy.empty_like(v)
    scalars = kernels._attention_scalars(T, H, Hkv, Dh)
    suffix = "f32" if dtype == np.float32 else "bf16"
    tiles = launch_plan.ATTENTION
    kernels._launch(kernels._kernel("attention", kernels.attention_entry("attention_backward_dq", Dh, suffix)),
                    B * H * -(-T // tiles.query_tile), tiles.threads,
                    (q, k, v, o, do, lse, delta, dq, *scalars))
    counted["backward_dq"] = cudaemu.global_bytes(reset=True)
    kernels._launch(kernels._kernel("attention", kernels.attention_entry("attention_backward", Dh, suffix)),
                    B * Hkv * -(-T // tiles.bwd_key_tile), tiles.threads,
                    (q, k, v, do, lse, delta, dk, dv, *scalars))
    counted["backward_dkdv"] = cudaemu.global_bytes(reset=True)
    assert counted == plan
    s = np.dtype(dtype).itemsize
    flash2_forward = B * H * sum((min(T, t0 + 64) - t0) * Dh * s + 2 * min(T, t0 + 64) * Dh * s
                                 for t0 in range(0, T, 64))
    assert counted["forward"] == (flash2_forward, B * H * T * (Dh * s + 4))


@pytest.mark.gpu
@pytest.mark.skipif(not GPU.standin, reason="the execution harness counts global bytes; a GPU does not")
def test_a_forward_reading_keys_past_the_causal_limit_fails_the_traffic_check(kernel_text):
    """Keys after a query tile's last query are masked anyway, so the results stay right: only the
    counted bytes show that K and V are read to T instead of to the tile's end."""
    kernel_text("running_sum = 0.0f;\n\n    const int key_end = min(tokens, r.q0 + ATTN_QUERY_TILE);",
                "running_sum = 0.0f;\n\n    const int key_end = tokens;")
    check_against_specification(1, 100, 2, 1, 64, np.float32)
    with pytest.raises(AssertionError):
        check_traffic(np.float32)


# ---------------------------------------------------------------------------- RoPE


def check_rope(shape, dtype):
    """RoPE forward and backward against layers.rope_forward/backward evaluated in float32 on the same
    inputs and tables: float32 to accumulation order, bfloat16 to one rounding of the output."""
    import cupy

    B, T, heads, Dh = shape
    x = np.random.default_rng(5).standard_normal(shape).astype(dtype)
    cos, sin = layers.rope_tables(T, Dh, 10000.0, dtype)
    wide = [np.asarray(a, np.float32) for a in (x, cos, sin)]
    for kernel, reference in ((kernels.rope_forward, layers.rope_forward), (kernels.rope_backward, layers.rope_backward)):
        got = to_numpy(kernel(*(cupy.asarray(a) for a in (x, cos, sin))))
        assert got.dtype == dtype and got.shape == shape
        tol = 1e-6 if dtype == np.float32 else 2 ** -8
        np.testing.assert_allclose(np.asarray(got, np.float32), reference(*wide).astype(dtype).astype(np.float32),
                                   rtol=tol, atol=tol, err_msg=kernel.__name__)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", [(2, 5, 3, 16), (1, 7, 2, 6)], ids=["B2_T5_h3_Dh16", "B1_T7_h2_Dh6"])
def test_rope_kernels_match_the_model(monkeypatch, lanes, shape, dtype):
    launched = set()
    launch = kernels._launch
    monkeypatch.setattr(kernels, "_launch", lambda kernel, *a, **k: (launched.add(kernel.name), launch(kernel, *a, **k)))
    check_rope(shape, dtype)
    suffix = "f32" if dtype == np.float32 else "bf16"
    assert {f"rope_forward_{suffix}", f"rope_backward_{suffix}"} <= launched


def check_rope_in_place(shape, dtype):
    """The forward written over its input (`out=x`, as the block's in-place RoPE does) equals the forward
    into a new array, bit for bit: each thread reads its pair of elements before it writes them."""
    import cupy

    B, T, heads, Dh = shape
    x = np.random.default_rng(6).standard_normal(shape).astype(dtype)
    cos, sin = (cupy.asarray(a) for a in layers.rope_tables(T, Dh, 10000.0, dtype))
    fresh = to_numpy(kernels.rope_forward(cupy.asarray(x), cos, sin))
    inside = cupy.asarray(x)
    assert kernels.rope_forward(inside, cos, sin, out=inside) is inside
    np.testing.assert_array_equal(to_numpy(inside).view(np.uint8), fresh.view(np.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["f32", "bf16"])
def test_rope_in_place_equals_rope_into_a_new_array(lanes, dtype):
    check_rope_in_place((2, 5, 3, 16), dtype)


@pytest.mark.gpu
def test_rope_in_place_mutant_fails_the_check(kernel_text):
    # the rotation's second element computed from the first one's new value: wrong only in place
    kernel_text("out[at] = from_float<T>(BACKWARD ? x1 * c1 + x2 * s2 : x1 * c1 - x2 * s1);\n"
                "        out[at + half] = from_float<T>(BACKWARD ? x2 * c2 - x1 * s1 : x2 * c2 + x1 * s2);",
                "out[at] = from_float<T>(BACKWARD ? x1 * c1 + x2 * s2 : x1 * c1 - x2 * s1);\n"
                "        out[at + half] = from_float<T>(BACKWARD ? x2 * c2 - x1 * s1 : x2 * c2 + to_float(x[at]) * s2);")
    with pytest.raises(AssertionError):
        check_rope_in_place((1, 5, 2, 8), np.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("old,new", [("x2 * c2 - x1 * s1 :", "x2 * c2 + x1 * s1 :"), ("x2 * c2 + x1 * s2)", "x2 * c2 - x1 * s2)")],
                         ids=["backward sign", "forward sign"])
def test_rope_mutations_fail_the_check(kernel_text, old, new):
    kernel_text(old, new)
    with pytest.raises(AssertionError):
        check_rope((1, 5, 2, 8), np.float32)
