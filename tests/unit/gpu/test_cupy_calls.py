"""Every CuPy call the engine's GPU path makes has been checked against CuPy 14.2.0's source.

The stand-in records each distinct call signature (function, operand dtypes and ranks, output,
broadcasting: testing/cupy_standin/cupy/_record.py) while GPU training steps run -- every arch and
dtype, the recompute modes, and the attention both through the fused kernels and through the
CuPy operations the GPU path runs for head dims beyond them -- and the test fails on any signature missing from
tests/cupy_calls_checked.txt, whose rows each cite the CuPy v14.2.0 source line that routes the
call to code that takes it. A new call, or an old one with a new dtype or rank, must be read in
CuPy's source before it lands. The mutation tests put a call CuPy 14.2 handles differently back
into the engine and show that these checks catch it.
"""

import contextlib
import dataclasses
import functools
import inspect
import re
from pathlib import Path

import pytest

from tests.support.gpu_setup import GPU
from tests.support.gpu_steps import ARCHS, DTYPES, step

pytestmark = pytest.mark.gpu

TABLE = Path(__file__).resolve().parents[2] / "cupy_calls_checked.txt"
RECOMPUTE = [("full", "layer"), ("svd", "lowrank"), ("cola", "layer"), ("cola", "lowrank"), ("cola", "selective")]
# the unfused attention's ways: handed the kept statistics (lowrank); a plain forward, then one keeping
# the probability tiles for the backward that follows (layer)
UNFUSED = [("cola", "lowrank"), ("full", "layer")]
CITATION = re.compile(r"^cupy[\w/]*\.(pyx|pxd|py|h):\d+\s")


def _needs_standin():
    if not GPU.standin:
        pytest.skip("call signatures are recorded by the CuPy stand-in; on a real GPU CuPy itself is the check")


def checked_table():
    rows = {}
    for n, line in enumerate(TABLE.read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        sig, bar, cite = line.partition("|")
        assert bar and CITATION.match(cite.strip() + " "), f"{TABLE.name}:{n}: no CuPy source line cited: {line!r}"
        rows[" ".join(sig.split())] = cite.strip()
    return rows


@contextlib.contextmanager
def unfused_attention():
    """The GPU path's attention as it runs for a head dim above the fused kernels' limit
    (layers._fused_attention): batched GEMMs and CuPy operations. The limit is lowered below the
    test model's head dim, so the same branch is taken."""
    from boostmpi.gpu import launch_plan

    plan = launch_plan.ATTENTION
    launch_plan.ATTENTION = dataclasses.replace(plan, head_dim_max=0)
    try:
        yield
    finally:
        launch_plan.ATTENTION = plan


def record_steps(runs, unfused=False):
    from cupy import _record

    with _record.recording() as calls, (unfused_attention() if unfused else contextlib.nullcontext()):
        for arch, dtype, train in runs:
            step(arch, "gpu", dtype, train=train)
    return calls


@functools.lru_cache(maxsize=None)
def engine_calls():
    runs = [(arch, dtype, None) for arch in ARCHS for dtype in DTYPES]
    runs += [(arch, dtype, dict(recompute=rc)) for arch, rc in RECOMPUTE for dtype in DTYPES]
    unfused = [(arch, dtype, dict(recompute=rc)) for arch, rc in UNFUSED for dtype in DTYPES]
    return frozenset(record_steps(runs)) | frozenset(record_steps(unfused, unfused=True))


def unchecked(calls):
    return sorted(set(calls) - set(checked_table()))


def test_every_cupy_call_of_a_gpu_step_is_checked_against_cupys_source():
    _needs_standin()
    calls = engine_calls()
    assert any(c.startswith("cublas.gemm A14 B14 C14") for c in calls), "no bfloat16 strided-batched GEMM recorded"
    missing = unchecked(calls)
    assert not missing, ("CuPy calls not yet checked against CuPy 14.2.0's source (read the routing there, then "
                         f"add a row with the source line to {TABLE.name}):\n  " + "\n  ".join(missing))


def test_a_new_call_signature_fails_the_check(monkeypatch):
    """Mutation: the unfused attention's batched products back on CuPy's matmul in float32 (a batched
    `matmul float32[4] float32[4]`, a signature the table does not list) are reported."""
    _needs_standin()
    from boostmpi.model import layers

    monkeypatch.setattr(layers, "batched_matmul", lambda a, b: layers.get_array_module(a).matmul(a, b))
    missing = unchecked(record_steps([("full", "float32", None)], unfused=True))
    assert "matmul float32[4] float32[4]" in missing, missing


def test_the_unfused_attention_is_what_the_gpu_path_runs_past_the_kernels_head_dim(monkeypatch):
    """The recorded unfused runs take the branch a head dim above the fused kernels' limit takes:
    no attention kernel is launched in them, and the fused runs launch all three."""
    _needs_standin()
    from boostmpi.gpu import kernels

    launched = []
    launch = kernels._launch
    monkeypatch.setattr(kernels, "_launch", lambda kernel, *a, **k: (launched.append(kernel.name), launch(kernel, *a, **k)))
    record_steps([("full", "float32", None)], unfused=True)
    assert launched and not [name for name in launched if name.startswith("attention_")], launched
    record_steps([("full", "float32", None)])
    assert {"attention_forward_hd64_f32", "attention_backward_dq_hd64_f32", "attention_backward_hd64_f32"} <= set(launched)


def _b_products_with_cupys_batched_matmul():
    """btp's B products with the batched pairs multiplied by CuPy's own matmul."""
    import textwrap

    from boostmpi.parallel.tensor_parallel import btp

    src = textwrap.dedent(inspect.getsource(btp.BottleneckTP._b_products))
    mutant = src.replace("outs += list(matmul(Zb, B))", "outs += list(get_array_module(Zs).matmul(Zb, B))")
    assert mutant != src, "_b_products no longer multiplies its batched pairs through layers.matmul"
    namespace = {}
    exec(compile(mutant, btp.__file__, "exec"), vars(btp), namespace)  # noqa: S102 - the mutant
    return namespace["_b_products"]


def test_cupys_batched_bf16_matmul_in_the_grouped_b_products_fails_a_gpu_step(monkeypatch):
    """Mutation: with the batched bfloat16 B factors (k/v, gate/up) on CuPy's matmul, a cola bfloat16
    step fails as it would on a GPU with CuPy 14.2 (its integer GEMM kernel and dtype 'E')."""
    _needs_standin()
    from boostmpi.parallel.tensor_parallel import btp

    monkeypatch.setattr(btp.BottleneckTP, "_b_products", _b_products_with_cupys_batched_matmul())
    with pytest.raises(TypeError, match="data type 'E' not understood"):
        step("cola", "gpu", "bfloat16")
    monkeypatch.undo()
    step("cola", "gpu", "bfloat16")  # and the real code runs
