"""The GPU path against the CPU path on the same weights (runs only where CuPy reaches a GPU)."""

import numpy as np
import pytest

from boostmpi.backend import gpu_unavailable_reason, to_numpy
from boostmpi.config import config_from_dict

reason = gpu_unavailable_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(reason is not None, reason=f"no usable GPU: {reason}")]

MODEL = dict(vocab_size=61, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96, rank=16, seq_len=16)


def _step(arch, device, dtype):
    from boostmpi.parallel.engine import Engine

    cfg = config_from_dict({"model": dict(MODEL, arch=arch), "train": {"device": device, "dtype": dtype, "micro_batch_size": 2}})
    eng = Engine(cfg)
    x = np.random.default_rng(0).integers(0, 61, (2, 17))
    loss = eng.forward_backward([(x[:, :-1], x[:, 1:])])
    return loss, {s.name: to_numpy(eng.grads[s.name]).astype(np.float64) for s in eng.specs}


@pytest.mark.parametrize("arch", ["full", "svd", "cola"])
@pytest.mark.parametrize("dtype,tol", [("float32", 2e-4), ("bfloat16", 5e-2)])
def test_gpu_step_matches_cpu(arch, dtype, tol):
    cpu_loss, cpu_grads = _step(arch, "cpu", "float64")
    gpu_loss, gpu_grads = _step(arch, "gpu", dtype)
    assert abs(gpu_loss - cpu_loss) <= tol * abs(cpu_loss)
    for name, g in cpu_grads.items():
        err = np.abs(gpu_grads[name] - g).max() / (np.abs(g).max() + 1e-12)
        assert err <= tol * 10, (name, err)
