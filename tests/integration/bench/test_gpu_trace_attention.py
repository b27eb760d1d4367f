"""bench/gpu_trace.py's attention entry: the own kernels and the library backends' calls priced by a
profile's measured attention rates, on the causal FLOP count; the launches and bytes of the trace as
before.

Runs bench/gpu_trace.py's engine step on the CuPy stand-in (the paper's 7B layout scaled down by 32,
one layer, one rank) in a child process (gpu_trace imports bench/common.py before numpy), prices its
trace with rate tables given to the profile (`machine.attention_rates`) and without them, and records
a library backend through the backend seam (`boostmpi.gpu.attention.use`), here a stand-in backend
whose forward and backward issue CuPy work of their own that the trace must not count apart."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.gpu_setup import GPU
from tests.support.paths import BENCH, pythonpath_with

ROOT = Path(__file__).resolve().parents[3]
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not GPU.standin, reason="traces on the CuPy stand-in; a real GPU is in use")]

SCRIPT = r'''
import json, sys, types
bench, mutant = sys.argv[1:3]
sys.argv = ["gpu_trace.py"]
import gpu_trace as gt  # imports bench/common.py before numpy
import cupy
import ml_dtypes
from boostmpi.sim import trace as sim_trace
from boostmpi.sim.machines import load_machine

if mutant == "full-square":
    gt.causal_flops = lambda B, T, H, Dh: (4.0 * B * H * T * T * Dh, 10.0 * B * H * T * T * Dh)
if mutant == "no-share":  # each backward launch priced as the whole backward
    right = gt.attention_kernel
    def attention_kernel(name, args):
        fields = right(name, args)
        if fields["direction"] == "backward":
            B, T, H, Dh = args[0].shape
            fields["flops"] = gt.causal_flops(B, T, H, Dh)[1]
        return fields
    gt.attention_kernel = attention_kernel

# the attention seam (use/current), and below a library backend that allocates and copies on its own
from boostmpi.gpu import attention as seam


class Library:
    name = "cudnn"
    deterministic = False

    def forward(self, q, k, v, alloc=None):
        o = q.copy()  # CuPy work inside the call: part of the library's one op
        return o, (q, k, v)

    def backward(self, do, ctx):
        q, k, v = ctx
        return do.copy(), cupy.zeros_like(k), cupy.zeros_like(v)


machine = load_machine("h100-sxm")
# rate tables in the profile's TOML layout ([attention.<backend>])
RATES = {"own": {"source": "bench/log/attention.md", "wmma": {"d128": {"forward": 8e12, "backward": 10e12}},
                 "fma": {"d128": {"forward": 11e12, "backward": 9e12}}},
         "cudnn": {"source": "bench/log/attention.md", "forward": 1e12, "backward": 0.8e12}}
try:  # the performance model's own tables, where it has them
    from dataclasses import replace
    from boostmpi.sim.attention_rates import parse_tables
    rated = replace(machine, attention_rates=parse_tables(RATES, {"peak_flops": machine.peak_flops, "vendor": "nvidia"},
                                                          "test"))
except ImportError:
    rated = types.SimpleNamespace(**{f: getattr(machine, f) for f in machine.__dataclass_fields__})
    rated.peak = machine.peak
    rated.attention_rates = RATES
rec = gt.Recorder()
gt.install(rec)
ops, _ = gt.trace_step(rec, gt.config(32, 1))
attention = [op for op in ops if op.kind == "attention"]
out = {"names": [op.name for op in attention], "shape": [4, 128, 1, 128]}
for name, m in (("rated", rated), ("profile", machine)):
    p, q = gt.price(ops, m), sim_trace.price(ops, m)
    out[name] = {"ours": p, "sim": q}
out["site_seconds"] = sum(row[4] for row in gt.by_site(ops, rated) if row[1] == "attention")
out["priced_by"] = gt._attention_priced_by(ops, rated)

# the library backend, given to the engine's seam, recorded one op per call
library = Library()
seam.use(library)
q = cupy.ones((2, 64, 4, 64), dtype=ml_dtypes.bfloat16)
kv = cupy.ones((2, 64, 2, 64), dtype=ml_dtypes.bfloat16)
rec.ops, rec.on = [], True
o, ctx = seam.current().forward(q, kv, kv)
grads = seam.current().backward(o, ctx)
rec.on = False
out["library"] = [[op.kind, op.name, op.nbytes, op.flops, op.direction, op.backend] for op in rec.ops]
out["library_seconds"] = gt.price(rec.ops, rated)["attention"]
try:
    gt.attention_rate(rated, "torch", None, 64, "forward")
except Exception as exc:
    out["missing"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
'''


def _run(tmp_path, mutant="none"):
    script = tmp_path / "trace_attention.py"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(script), str(ROOT / "bench"), mutant], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=pythonpath_with(BENCH)),
                          timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _check(out):
    B, T, H, Dh = out["shape"]
    forward = 2.0 * B * H * T * T * Dh  # the causal count: QK^T and PV over the lower triangle
    names = out["names"]
    n_fwd = sum(n.startswith("attention_forward") for n in names)
    n_bwd = sum(n.startswith("attention_backward_dq") for n in names)
    assert n_fwd >= 1 and n_bwd >= 1 and len(names) == n_fwd + 2 * n_bwd, names
    # the stand-in suite pins the FMA kernels (tests/conftest.py); the WMMA ones have rates of their own
    rate = {True: (8e12, 10e12), False: (11e12, 9e12)}[all("_tc_" in n for n in names)]
    rated = out["rated"]
    expected = n_fwd * forward / rate[0] + n_bwd * 2.5 * forward / rate[1]
    assert rated["ours"]["attention"] == pytest.approx(expected, rel=1e-9)
    assert out["site_seconds"] == pytest.approx(expected, rel=1e-9)
    for name in ("rated", "profile"):  # the trace's counts, as before; the attention moved out of elementwise
        ours, sim = out[name]["ours"], out[name]["sim"]
        assert {k: ours[k] for k in sim if k != "elementwise"} == {k: sim[k] for k in sim if k != "elementwise"}
    plain = out["profile"]  # the built-in profile priced as the performance model prices a trace
    assert plain["ours"]["elementwise"] + plain["ours"]["attention"] == pytest.approx(plain["sim"]["elementwise"])
    assert "priced by the measured rates" in out["priced_by"]
    # the library: one op per call (its own CuPy copies not apart), FlashAttention-2's bytes, causal FLOPs
    lib_fwd = 2.0 * 2 * 4 * 64 * 64 * 64
    assert [(k, n, f, d, b) for k, n, _, f, d, b in out["library"]] == [
        ("attention", "cudnn_forward", lib_fwd, "forward", "cudnn"),
        ("attention", "cudnn_backward", 2.5 * lib_fwd, "backward", "cudnn")]
    from boostmpi.sim.operations import flash2_traffic

    traffic = flash2_traffic(2 * 4, 2 * 2, 64, 64, 2)
    assert [op[2] for op in out["library"]] == [sum(traffic["forward"]), sum(traffic["backward"])]
    assert out["library_seconds"] == pytest.approx(lib_fwd / 1e12 + 2.5 * lib_fwd / 0.8e12)
    assert out["missing"].startswith("UserError: machine profile h100-sxm has no rate for attention backend 'torch'")


def test_attention_is_priced_by_measured_rates(tmp_path):
    _check(_run(tmp_path))


@pytest.mark.parametrize("mutant", ["full-square", "no-share"])
def test_mutant_flop_counts_are_caught(tmp_path, mutant):
    """The full T x T square instead of the causal half, or each own backward launch priced as the whole
    backward: the priced attention is wrong and the check fails."""
    with pytest.raises(AssertionError):
        _check(_run(tmp_path, mutant))


def test_a_profile_without_the_steps_attention_rate_is_one_line_exit_2():
    """bench/gpu_trace.py on a profile that rates no own kernels (a100-80gb; its default is h200, which
    does): one error line, exit 2, no traceback."""
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_trace.py"), "--scale", "32", "--machine",
                           "a100-80gb"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1].startswith(
        "error: machine profile a100-80gb has no rate for attention backend 'own'")
