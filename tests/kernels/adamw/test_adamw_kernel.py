"""The fused AdamW kernel (kernels/adamw.cu) against the NumPy AdamW it replaces on a GPU.

boostmpi.train.optim.AdamW.step on CuPy float32 master weights launches one kernel over the flat
slice (boostmpi.gpu.adamw_kernels.adamw_step) instead of its dozen vector operations and two more per
weight-decay range; the NumPy code of the same step is the specification. Three steps with weight
decay on some ranges, a gradient scale, and a slice whose length leaves a scalar tail, on the
device (the stand-in runs the kernel's source through the execution harness).
"""

from types import SimpleNamespace

import numpy as np
import pytest

from boostmpi.train.optim import AdamW

pytestmark = pytest.mark.gpu

N = 1003  # not a multiple of the 4-float vector: a scalar tail
SPANS = {"embed": (0, 300), "norm": (300, 364), "w": (364, 900), "final_norm": (900, 950), "head": (950, N)}
DECAY = {"embed", "w", "head"}
TR = SimpleNamespace(beta1=0.9, beta2=0.95, adam_eps=1e-8, weight_decay=0.1, grad_clip=0.0)


def optimizer(xp, p0):
    params = SimpleNamespace(data=xp.asarray(p0.copy()), size=N, spans=SPANS)
    specs = [SimpleNamespace(name=name, decay=name in DECAY) for name in SPANS]
    return AdamW(params, specs, TR, xp)


def run(xp, steps):
    rng = np.random.default_rng(5)
    p0 = rng.standard_normal(N).astype(np.float32)
    opt = optimizer(xp, p0)
    for t, (scale, lr) in enumerate(steps):
        g = rng.standard_normal(N).astype(np.float32) * (t + 1)
        opt.step(xp.asarray(g), lr, grad_scale=scale)
    to_host = (lambda a: a) if xp is np else (lambda a: a.get())
    return [to_host(a) for a in (opt.master, opt.m, opt.v)]


def test_adamw_kernel_matches_the_numpy_update(monkeypatch):
    import cupy

    from boostmpi.gpu import kernels

    launched = []
    launch = kernels._launch
    monkeypatch.setattr(kernels, "_launch", lambda k, *a, **kw: (launched.append(k.name), launch(k, *a, **kw)))
    steps = [(1.0, 1e-3), (0.5, 2e-3), (0.25, 1e-3)]
    got = run(cupy, steps)
    want = run(np, steps)
    assert launched == ["adamw_step_f32"] * 3
    for name, a, b in zip(("p", "m", "v"), got, want):
        np.testing.assert_allclose(a, b, rtol=2e-6, atol=2e-6 * np.abs(b).max(), err_msg=name)
    # weight decay only where it applies: with zero gradients and moments, only decayed entries move
    p0 = np.ones(N, np.float32)
    opt = optimizer(cupy, p0)
    opt.step(cupy.zeros(N, np.float32), 0.5)
    moved = opt.master.get() != 1.0
    expected = np.zeros(N, bool)
    for name in DECAY:
        expected[slice(*SPANS[name])] = True
    np.testing.assert_array_equal(moved, expected)


def test_adamw_kernel_refuses_what_it_cannot_update():
    import cupy

    from boostmpi.gpu import adamw_kernels

    p = cupy.zeros(8, np.float32)
    with pytest.raises(TypeError, match="float32"):
        adamw_kernels.adamw_step(*(cupy.zeros(8, np.float64),) * 4, cupy.zeros(0, np.int64), 1e-3, 0.9, 0.95, 1e-8, 0.1, 1.0, 1)
    with pytest.raises(ValueError, match="pairs"):
        adamw_kernels.adamw_step(p, p, p, p, cupy.zeros(3, np.int64), 1e-3, 0.9, 0.95, 1e-8, 0.1, 1.0, 1)


@pytest.fixture
def mutated_kernels(monkeypatch):
    """`mutate(file, old, new)`: the loader compiles kernels/<file>.cu with `old` replaced by `new`."""
    import functools

    from boostmpi.gpu import kernels

    real = kernels.kernel_source
    changes = {}

    def source(name):
        text = real(name)
        if name in changes:
            old, new = changes[name]
            assert old in text, f"the mutation target {old!r} is not in {name}.cu any more"
            text = text.replace(old, new)
        return text

    monkeypatch.setattr(kernels, "kernel_source", source)
    monkeypatch.setattr(kernels, "_module", functools.lru_cache(maxsize=None)(kernels._module.__wrapped__))
    return lambda name, old, new: changes.__setitem__(name, (old, new))


@pytest.mark.parametrize("old,new", [
    ("return (lo & 1) != 0;", "return (lo & 1) == 0;"),  # weight decay on the wrong ranges
    ("sqrtf(vv[k]) / sqrt_bc2", "sqrtf(vv[k])"),  # no second-moment bias correction
])
def test_a_wrong_adamw_kernel_is_caught(mutated_kernels, old, new):
    mutated_kernels("adamw", old, new)
    with pytest.MonkeyPatch.context() as patch, pytest.raises(AssertionError):
        test_adamw_kernel_matches_the_numpy_update(patch)


def test_a_btp_kernel_without_the_silu_derivative_is_caught(mutated_kernels):
    """The btp backward kernel's CuPy-level check (tests/kernels/test_kernels.py) fails on a kernel that
    ignores cola's SiLU."""
    from tests.kernels.test_kernels import test_btp_backward_kernels_match_the_model

    mutated_kernels("btp", "act ? dv[k] * silu_derivative(zv[k]) : dv[k]", "dv[k]")
    with pytest.raises(AssertionError, match="act=True"):
        test_btp_backward_kernels_match_the_model(None, "float32", 64, 64)


# (lr, squared gradient norm, max_norm): under the threshold, clipped, exactly at it (sqrt(4) = 2, not
# clipped), a NaN and an infinite norm (not clipped), clipping off
DEVICE_STEPS = [(1e-3, 0.25, 1.0), (2e-3, 9.0, 1.0), (5e-4, 4.0, 2.0), (1e-3, float("nan"), 1.0),
                (1e-3, float("inf"), 1.0), (3e-3, 9.0, 0.0)]


def test_the_device_read_update_is_bitwise_the_by_value_one(monkeypatch):
    """`AdamW.step_on_device` (kernels/adamw.cu's adamw_step_device_f32: lr, the bias corrections and
    the clipping read from device buffers) gives bitwise the parameters and moments of `AdamW.step` handed
    the host's numbers (`clip_coefficient` of the host's norm), step after step."""
    import math

    import cupy

    from boostmpi.gpu import kernels
    from boostmpi.train.optim import clip_coefficient

    launched = []
    launch = kernels._launch
    monkeypatch.setattr(kernels, "_launch", lambda k, *a, **kw: (launched.append(k.name), launch(k, *a, **kw)))
    rng = np.random.default_rng(7)
    p0 = rng.standard_normal(N).astype(np.float32)
    host, device = optimizer(cupy, p0), optimizer(cupy, p0)
    scalars = cupy.zeros(3, np.float32)
    for lr, grad_sq, max_norm in DEVICE_STEPS:
        g = cupy.asarray(rng.standard_normal(N).astype(np.float32))
        host.step(g, lr, grad_scale=clip_coefficient(math.sqrt(grad_sq), max_norm))
        scalars.set(device.device_scalars(lr))
        device.step_on_device(g, scalars, cupy.asarray(np.float64(grad_sq)), max_norm)
        for name in ("master", "m", "v"):
            want, got = getattr(host, name).get(), getattr(device, name).get()
            assert np.array_equal(want.view(np.uint32), got.view(np.uint32)), f"{name} after lr {lr}, |g|^2 {grad_sq}"
    assert host.t == device.t == len(DEVICE_STEPS)
    assert launched == ["adamw_step_f32", "adamw_step_device_f32"] * len(DEVICE_STEPS)
    with pytest.raises(TypeError, match="float32 scalars"):
        device.step_on_device(g, cupy.zeros(3, np.float64), cupy.asarray(np.float64(1.0)), 1.0)


@pytest.mark.parametrize("old,new", [
    ("norm <= max_norm", "norm < max_norm"),  # a norm equal to the threshold clipped
    ("!isfinite(norm) || ", ""),  # a NaN norm clips by NaN
    ("clip_scale(*grad_sq, max_norm), scalars[1], scalars[2]", "1.0f, scalars[1], scalars[2]"),  # no clipping
    ("scalars[0],", "scalars[1],"),  # the step size as the decay
])
def test_a_wrong_device_read_update_is_caught(mutated_kernels, old, new):
    mutated_kernels("adamw", old, new)
    with pytest.MonkeyPatch.context() as patch, pytest.raises(AssertionError):
        test_the_device_read_update_is_bitwise_the_by_value_one(patch)


def sum_squares_case(xp):
    """A flat float32 gradient of an odd length and ranges that skip parts of it (a tp-replicated block
    on tp rank > 0), start and end off any vector boundary, and include an empty one and the buffer's end."""
    g = np.random.default_rng(9).standard_normal(N).astype(np.float32)
    ranges = [(0, 300), (364, 900), (900, 900), (901, 950), (951, N)]
    return xp.asarray(g), ranges


def test_the_gradient_norm_kernel_sums_the_squares_of_its_ranges(monkeypatch):
    """kernels/adamw.cu's `sum_squares_ranges_f32`: one launch for every range, then the sum of its
    per-block partials, equal to the NumPy sums of squares range by range."""
    import cupy

    from boostmpi.gpu import adamw_kernels, kernels

    launched = []
    launch = kernels._launch
    monkeypatch.setattr(kernels, "_launch", lambda k, *a, **kw: (launched.append(k.name), launch(k, *a, **kw)))
    g, ranges = sum_squares_case(cupy)
    got = adamw_kernels.sum_squares_ranges(g, cupy.asarray(np.array(ranges, np.int64).reshape(-1)))
    host = g.get().astype(np.float64)
    want = sum(float((host[a:b] ** 2).sum()) for a, b in ranges)
    assert launched == ["sum_squares_ranges_f32"]
    assert got.shape == () and got.dtype == np.float64
    assert float(got) == pytest.approx(want, rel=1e-6)
    assert float(adamw_kernels.sum_squares_ranges(g, cupy.zeros(0, np.int64))) == 0.0
    with pytest.raises(ValueError, match="pairs"):
        adamw_kernels.sum_squares_ranges(g, cupy.zeros(3, np.int64))
    with pytest.raises(TypeError, match="float32"):
        adamw_kernels.sum_squares_ranges(g.astype(np.float64), cupy.zeros(2, np.int64))


@pytest.mark.parametrize("old,new", [
    ("acc += g[i] * g[i];", "acc += g[i];"),  # the sum, not of squares
    ("for (int r = 0; r < n_ranges; ++r)", "for (int r = 0; r + 1 < n_ranges; ++r)"),  # the last range left out
])
def test_a_wrong_gradient_norm_kernel_is_caught(mutated_kernels, old, new):
    mutated_kernels("adamw", old, new)
    with pytest.MonkeyPatch.context() as patch, pytest.raises(AssertionError):
        test_the_gradient_norm_kernel_sums_the_squares_of_its_ranges(patch)


def _gpu_norm_and_gradients():
    from boostmpi.backend import to_numpy
    from tests.support.gpu_steps import batches, config

    from boostmpi.parallel.engine import Engine

    eng = Engine(config("cola", "gpu", "float32"))
    eng.forward_backward(batches())
    return eng.grad_norm(), to_numpy(eng.grads.data).astype(np.float64)


def test_the_engine_takes_its_gradient_norm_from_the_kernel(monkeypatch):
    """A GPU step's gradient norm (what clipping reads) comes from one `sum_squares_ranges` launch
    and equals the norm of the whole gradient (one rank: every parameter counted once). The mutant
    (the engine's ranges without their last block) gives another norm."""
    from boostmpi.gpu import adamw_kernels
    from boostmpi.parallel.data_parallel import DataParallel

    calls = []
    real = adamw_kernels.sum_squares_ranges
    monkeypatch.setattr(adamw_kernels, "sum_squares_ranges", lambda *a: (calls.append(a[1].size), real(*a))[1])
    norm, grads = _gpu_norm_and_gradients()
    assert len(calls) == 1 and calls[0] >= 2
    assert norm == pytest.approx(float(np.sqrt((grads ** 2).sum())), rel=1e-5)
    right = DataParallel._norm_ranges
    monkeypatch.setattr(DataParallel, "_norm_ranges", lambda self, *args: right(self, *args)[:-1])
    mutant_norm, grads = _gpu_norm_and_gradients()
    assert mutant_norm != pytest.approx(float(np.sqrt((grads ** 2).sum())), rel=1e-5)


def test_a_btp_rescale_that_writes_a_wrong_statistic_is_caught(mutated_kernels):
    """The rescale kernel's row statistic (what the backward reads instead of an rstd computed apart)
    is checked: the mutant writes rstd squared."""
    from tests.kernels.test_kernels import test_btp_backward_kernels_match_the_model

    mutated_kernels("btp", "if (threadIdx.x == 0) *rstd_out = rstd;", "if (threadIdx.x == 0) *rstd_out = rstd * rstd;")
    with pytest.raises(AssertionError, match="btp rescale rstd"):
        test_btp_backward_kernels_match_the_model(None, "float32", 64, 64)


def _optimizer_device_bytes(cupy, p0, tr):
    pool = cupy.get_default_memory_pool()
    params = SimpleNamespace(data=cupy.asarray(p0), size=N, spans=SPANS)
    specs = [SimpleNamespace(name=name, decay=name in DECAY) for name in SPANS]
    before = pool.used_bytes()
    opt = AdamW(params, specs, tr, cupy)
    return pool.used_bytes() - before, opt


def test_the_fused_optimizer_holds_only_its_moments(monkeypatch):
    """With the fused kernel (a GPU, float32 master weights) AdamW's device memory is its two moments:
    no scratch buffer and no scaled-gradient buffer (two more slices, 5.6 GB per rank of the paper's
    7B at tp 4), and clipping still reaches the update through the kernel's gradient scale. The
    mutant (the array path's buffers made anyway) holds four slices."""
    import cupy

    clipping = SimpleNamespace(**{**vars(TR), "grad_clip": 1.0})
    p0 = np.random.default_rng(4).standard_normal(N).astype(np.float32)
    held, opt = _optimizer_device_bytes(cupy, p0, clipping)
    assert opt.fused and held == opt.m.data.mem.size + opt.v.data.mem.size
    g = np.random.default_rng(5).standard_normal(N).astype(np.float32)
    opt.step(cupy.asarray(g), 1e-3, grad_scale=0.5)
    ref = AdamW(SimpleNamespace(data=p0.copy(), size=N, spans=SPANS),
                [SimpleNamespace(name=name, decay=name in DECAY) for name in SPANS], clipping, np)
    ref.step(g, 1e-3, grad_scale=0.5)
    np.testing.assert_allclose(opt.master.get(), ref.master, rtol=2e-6, atol=2e-6)
    from boostmpi.train import optim

    monkeypatch.setattr(optim, "fused_update", lambda xp, dtype: False)  # the mutant: the array path's buffers
    mutant_held, _ = _optimizer_device_bytes(cupy, p0, clipping)
    assert mutant_held != opt.m.data.mem.size + opt.v.data.mem.size


def test_a_residual_norm_kernel_that_normalises_the_branch_is_caught(mutated_kernels):
    """The fused residual add + norm statistic is checked against the add then the statistic: the
    mutant forms x * w of the branch output instead of the new residual."""
    from tests.kernels.test_kernels import test_rmsnorm_kernels_match_the_model

    mutated_kernels("rmsnorm", "store_vec<V>(s2 + j, hv);\n        load_vec<V>(w + j, v);",
                    "store_vec<V>(s2 + j, hv);\n        load_vec<V>(y + j, hv);\n        load_vec<V>(w + j, v);")
    with pytest.raises(AssertionError, match="residual xw"):
        test_rmsnorm_kernels_match_the_model(None, "float32", 64)
