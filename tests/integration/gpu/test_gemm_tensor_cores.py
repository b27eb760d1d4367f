"""Every GEMM of a bfloat16 GPU step runs bf16-in/fp32-accumulate on tensor cores.

Derived from what the CuPy stand-in records of each cuBLAS GEMM it carries out (`cupy._record.gemms`:
the cudaDataType of A, B and C and the compute type, as the binding received them; CuPy's own 2-D
matmul reaches `gemmEx` there as it does on a device), classified by the cuBLAS guide's type table
(`cupy.cuda.cublas.bf16_tensor_core`), never by what the engine says of itself. The mutation test
puts the A factors' weight gradients back in float32 (as the engine had them) and shows the count
catches it.
"""

import inspect

import pytest

from tests.support.gpu_setup import GPU
from tests.support.gpu_steps import ARCHS, step

pytestmark = pytest.mark.gpu

RECOMPUTE = [("full", "layer"), ("svd", "lowrank"), ("cola", "layer"), ("cola", "lowrank")]


def _needs_standin():
    if not GPU.standin:
        pytest.skip("the GEMM records are the stand-in's; on a real GPU profile the step instead")


def step_gemms(arch, dtype="bfloat16", train=None):
    from cupy import _record

    with _record.gemms() as log:
        step(arch, "gpu", dtype, train=train)
    return log


def not_on_tensor_cores(log):
    from cupy.cuda import cublas

    return [g for g in log if not cublas.bf16_tensor_core(g)]


@pytest.mark.parametrize("arch,recompute", [(a, "none") for a in ARCHS] + RECOMPUTE)
def test_every_gemm_of_a_bf16_step_is_on_tensor_cores(arch, recompute):
    _needs_standin()
    log = step_gemms(arch, train=dict(recompute=recompute))
    assert len(log) > 20, f"only {len(log)} GEMMs recorded"
    assert not not_on_tensor_cores(log), not_on_tensor_cores(log)
    # the weight gradients accumulate into the float32 gradient buffer in the GEMM itself (beta = 1)
    assert any(g.Ctype == 0 and not g.beta_zero for g in log)


def test_a_float32_step_is_counted_off_the_tensor_cores():
    """The count is not vacuous: every GEMM of a float32 step is a float32 one."""
    _needs_standin()
    log = step_gemms("cola", "float32")
    assert log and len(not_on_tensor_cores(log)) == len(log)


def test_float32_a_factor_weight_gradients_are_caught(monkeypatch):
    """Mutant: btp's A-factor weight gradients multiplied as they were, xw (bf16) by dP in float32
    through CuPy's matmul (which casts both to float32): a float32 GEMM each, which the count reports."""
    _needs_standin()
    from boostmpi.parallel.tensor_parallel import btp

    src = inspect.getsource(btp.BottleneckTP._a_grads)
    mutant = src.replace('matmul(xw.T, dP, out=whole, accumulate=True)', 'whole += xw.T @ dP.astype("float32")')
    mutant = mutant.replace('matmul(xw.T, dP[:, s], out=grads[f"{nm}/A"], accumulate=True)',
                            'grads[f"{nm}/A"] += xw.T @ dP[:, s].astype("float32")')
    assert mutant.count('.astype("float32")') == 2, "the A factors' weight gradient is no longer written as the mutant expects"
    namespace = {}
    exec(compile("if True:\n" + mutant, btp.__file__, "exec"), vars(btp), namespace)  # noqa: S102 - the mutant
    monkeypatch.setattr(btp.BottleneckTP, "_a_grads", namespace["_a_grads"])
    bad = not_on_tensor_cores(step_gemms("cola"))
    assert bad and all(g.Atype == g.Btype == 0 for g in bad), bad
