"""btp's online RMSNorm statistic travels in float32 in a bfloat16 GPU step.

The sum of squares of each token's residual shard is all-reduced with the rank-R products. In a
bfloat16 step it used to ride in the bfloat16 buffer (an 8-bit mantissa: rstd off by up to 2^-9
relative); now it is a float32 buffer reduced in the same collective. Here the strategy's
`_reduce_bottleneck` runs on the GPU path with a two-member group whose members hold the same
shard (each all-reduce doubles its buffers: exact in any float format, so only the statistic's
own storage can round): the bfloat16 step's rstd equals the float32 step's to float32 precision,
the bytes counted are the products' in bfloat16 plus the statistic's in float32, and a mutant
that puts the statistic back into the bfloat16 buffer is caught.
"""

import inspect
from types import SimpleNamespace

import numpy as np
import pytest

from tests.support.gpu_setup import GPU
from tests.support.gpu_steps import config

pytestmark = pytest.mark.gpu

N, R = 48, 24
BF16 = np.dtype(pytest.importorskip("ml_dtypes").bfloat16)


class DoublingGroup:
    """A tp group of two members holding the same shard: a sum all-reduce doubles each buffer."""

    size, rank = 2, 0

    def __init__(self):
        self.bytes, self.calls = 0, 0

    def allreduce(self, buf, op="sum"):
        return self.allreduce_many([buf])[0]

    def allreduce_many(self, bufs):
        self.calls += 1
        for b in bufs:
            self.bytes += b.nbytes
            b *= 2
        return bufs


def reduce_bottleneck(dtype, strategy_class=None):
    import cupy

    from boostmpi.precision import compute_dtype
    from boostmpi.model import layers
    from boostmpi.model.recompute import NO_TAPE
    from boostmpi.parallel.tensor_parallel.btp import BottleneckTP

    cfg = config("cola", "gpu", dtype, parallel=dict(tp=2))
    group = DoublingGroup()
    strategy = (strategy_class or BottleneckTP)(cfg, SimpleNamespace(tp=group))
    cd = compute_dtype(dtype, cupy)
    rng = np.random.default_rng(3)
    C = strategy.C // 2
    # values bfloat16 holds exactly, of spread magnitudes: the float32 sums of squares need all 24 bits
    x = (rng.standard_normal((N, C)) * np.exp(rng.uniform(-3, 3, (N, 1)))).astype(BF16).astype(np.float32)
    w = np.ones(C, np.float32)
    A = rng.standard_normal((C, R)).astype(BF16).astype(np.float32)
    xw, ss = layers.rmsnorm_online_stats(cupy.asarray(x).astype(cd), cupy.asarray(w).astype(cd))
    _, rstd, _ = strategy._reduce_bottleneck(xw, ss, cupy.asarray(A).astype(cd), [slice(0, R)], NO_TAPE)
    want = 1.0 / np.sqrt(2 * (x.astype(np.float64) ** 2).sum(axis=1) / strategy.C + strategy.eps)
    return rstd.get().reshape(-1).astype(np.float64), want, group


def test_bf16_norm_statistic_matches_float32_to_float32_precision():
    if not GPU.standin:
        pytest.skip("runs the strategy on the stand-in with an emulated two-member group")
    got_bf16, want, group = reduce_bottleneck("bfloat16")
    got_f32, _, group32 = reduce_bottleneck("float32")
    assert np.abs(got_f32 / want - 1).max() < 2e-6
    assert np.abs(got_bf16 / got_f32 - 1).max() < 2e-6, np.abs(got_bf16 / got_f32 - 1).max()
    assert (group.calls, group.bytes) == (1, N * R * 2 + N * 4)  # one collective: bf16 products, fp32 statistic
    assert (group32.calls, group32.bytes) == (1, N * R * 4 + N * 4)


def test_the_statistic_in_the_bf16_buffer_is_caught():
    """Mutant: the statistic rides in the bfloat16 buffer again (as it did); rstd is off by ~2^-9."""
    if not GPU.standin:
        pytest.skip("runs the strategy on the stand-in with an emulated two-member group")
    from boostmpi.parallel.tensor_parallel import btp

    src = inspect.getsource(btp.BottleneckTP._reduce_products)
    mutant = src.replace("ride = extra is not None and extra.dtype == x.dtype", "ride = extra is not None")
    assert mutant != src, "_reduce_products no longer decides where the statistic travels as the mutant expects"
    namespace = {}
    exec(compile("if True:\n" + mutant, btp.__file__, "exec"), vars(btp), namespace)  # noqa: S102 - the mutant
    mutated = type("MutatedBTP", (btp.BottleneckTP,), {"_reduce_products": namespace["_reduce_products"]})
    got, want, group = reduce_bottleneck("bfloat16", mutated)
    assert np.abs(got / want - 1).max() > 1e-4
    assert group.bytes == N * R * 2 + N * 2
