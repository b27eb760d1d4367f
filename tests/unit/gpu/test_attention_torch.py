"""The torch attention backend (boostmpi/gpu/attention_torch.py) without a GPU.

PyTorch's real CPU wheel runs SDPA and autograd. The CuPy arrays are the stand-in's (tests/
cupy_standin): `torch.from_dlpack` is given a view of a stand-in array's device memory (bfloat16
crossing as int16 and `.view(torch.bfloat16)`, since NumPy's DLPack has no bfloat16) and
`cupy.from_dlpack` copies a tensor into a new stand-in array (the stand-in cannot wrap foreign memory;
on a GPU both are zero-copy). Only `torch.cuda`'s stream calls are faked, and spies record what SDPA
and autograd were called with. Every torch call of the module is checked against torch 2.11's API
(tests/torch_api_2_11.txt). On a machine whose CuPy reaches a GPU nothing is faked.
"""

import ast
import contextlib
import inspect
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch  # the test extra pins the CPU wheel: missing, it is a failure, not a skip
from tests.support.gpu_setup import GPU, STANDIN

from boostmpi.gpu import attention_torch
from boostmpi.model import layers

API_LIST = Path(__file__).resolve().parents[2] / "torch_api_2_11.txt"
MODULE = Path(attention_torch.__file__)


class Record:
    def __init__(self):
        self.sdpa, self.grads, self.streams, self.current = [], [], [], None


@pytest.fixture
def rec(monkeypatch):
    """The stand-in's DLPack crossing and torch.cuda's stream calls faked (stand-in only), and
    spies on SDPA and autograd.grad."""
    import cupy

    r = Record()
    if not GPU.standin and attention_torch.problem("bfloat16"):  # a GPU, but no PyTorch for it
        pytest.skip(f"the torch backend cannot run on this GPU: {attention_torch.problem('bfloat16')}")
    if GPU.standin:
        import ml_dtypes
        from cupy import _memory

        def from_dlpack(x, **kwargs):
            if not isinstance(x, cupy.ndarray):
                raise TypeError(f"from_dlpack faked for stand-in arrays only, got {type(x)}")
            assert x.flags.c_contiguous
            raw, mem = _memory.host_view(x.data.ptr, x.nbytes)
            if x.dtype == ml_dtypes.bfloat16:
                t = torch.from_numpy(raw.view(np.int16).reshape(x.shape)).view(torch.bfloat16)
            else:
                t = torch.from_numpy(raw.view(x.dtype).reshape(x.shape))
            t._standin_owner = (x, mem)  # as a DLPack capsule keeps its producer alive
            return t

        def cupy_from_dlpack(t):
            assert t.is_contiguous() and not t.requires_grad, "real CuPy would get a strided or grad-requiring tensor"
            if t.dtype == torch.bfloat16:
                return cupy.asarray(t.view(torch.int16).numpy().view(ml_dtypes.bfloat16))
            return cupy.asarray(t.numpy())

        class ExternalStream:
            def __init__(self, stream_ptr, device=None):
                self.ptr, self.device = stream_ptr, device
                r.streams.append((stream_ptr, device))

        @contextlib.contextmanager
        def stream(s):
            before, r.current = r.current, s
            try:
                yield
            finally:
                r.current = before

        monkeypatch.setattr(torch, "from_dlpack", from_dlpack)
        monkeypatch.setattr(cupy, "from_dlpack", cupy_from_dlpack, raising=False)
        monkeypatch.setattr(torch.cuda, "ExternalStream", ExternalStream)
        monkeypatch.setattr(torch.cuda, "stream", stream)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    sdpa, grad = torch.nn.functional.scaled_dot_product_attention, torch.autograd.grad

    def sdpa_spy(query, key, value, *args, **kwargs):
        r.sdpa.append(dict(kwargs, args=args, shapes=(query.shape, key.shape, value.shape),
                           math=torch.backends.cuda.math_sdp_enabled(),
                           flash=torch.backends.cuda.flash_sdp_enabled(),
                           deterministic=torch.are_deterministic_algorithms_enabled(), stream=r.current,
                           leaves=(query._base, key._base, value._base)))
        return sdpa(query, key, value, *args, **kwargs)

    def grad_spy(outputs, inputs, *args, **kwargs):
        r.grads.append(dict(outputs=outputs, inputs=inputs, deterministic=torch.are_deterministic_algorithms_enabled(),
                            stream=r.current))
        return grad(outputs, inputs, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa_spy)
    monkeypatch.setattr(torch.autograd, "grad", grad_spy)
    return r


def _inputs(B, T, H, Hkv, Dh, seed):
    import ml_dtypes

    rng = np.random.default_rng(seed)
    bf16 = ml_dtypes.bfloat16
    q = rng.standard_normal((B, T, H, Dh)).astype(bf16)
    k = rng.standard_normal((B, T, Hkv, Dh)).astype(bf16)
    v = rng.standard_normal((B, T, Hkv, Dh)).astype(bf16)
    do = rng.standard_normal((B, T, H, Dh)).astype(bf16)
    return q, k, v, do


def _close(got, want, what):
    got = np.asarray(got, dtype=np.float32)
    err = float(np.abs(got - want).max())
    bound = 1.6e-2 * max(1.0, float(np.abs(want).max()))  # a few bfloat16 roundings of the largest value
    assert err <= bound, f"{what}: max |torch - NumPy| = {err:.3g} > {bound:.3g}"


@pytest.mark.parametrize("H, Hkv, Dh", [(4, 2, 64), (4, 2, 128), (2, 2, 64)])
def test_matches_the_numpy_attention_and_calls_sdpa_as_documented(rec, H, Hkv, Dh):
    import cupy

    B, T = 2, 13
    q, k, v, do = _inputs(B, T, H, Hkv, Dh, seed=Dh + H + Hkv)
    f32 = [a.astype(np.float32) for a in (q, k, v, do)]
    o_ref, cache = layers.attention_forward(*f32[:3])
    dq_ref, dk_ref, dv_ref = layers.attention_backward(f32[3].reshape(B, T, H * Dh), cache)

    backend = attention_torch.TorchAttention()
    assert backend.name == "torch" and backend.deterministic
    with cupy.cuda.Stream() as s:  # a stream of CuPy's own: SDPA must run on it
        qc, kc, vc, doc = (cupy.asarray(a) for a in (q, k, v, do))
        o, ctx = backend.forward(qc, kc, vc)
        assert len(rec.sdpa) == 1
        dq, dk, dv = backend.backward(doc, ctx)
        stream_ptr = s.ptr

    for got, shape in ((o, q.shape), (dq, q.shape), (dk, k.shape), (dv, v.shape)):
        assert isinstance(got, cupy.ndarray) and got.shape == shape and got.dtype == q.dtype and got.flags.c_contiguous
    _close(o.get(), o_ref.reshape(q.shape), "o")
    for got, want, name in ((dq, dq_ref, "dq"), (dk, dk_ref, "dk"), (dv, dv_ref, "dv")):
        _close(got.get(), want, name)

    (call,) = rec.sdpa  # one forward; the backward did not run SDPA again
    assert call.get("is_causal") is True and call.get("enable_gqa") is True and not call["args"]
    assert call.get("scale") == 1.0 / math.sqrt(Dh)  # PyTorch's default is the same: only the call can tell
    assert call["shapes"] == ((B, H, T, Dh), (B, Hkv, T, Dh), (B, Hkv, T, Dh))  # K, V not repeated
    assert call["math"] is False and call["flash"] is True  # the fused kernels only: math excluded
    assert call["deterministic"] is True and not torch.are_deterministic_algorithms_enabled()  # scoped
    assert all(t.requires_grad and t.is_leaf for t in call["leaves"])  # transposed views of the leaves
    (g,) = rec.grads
    assert g["outputs"] is ctx.out and tuple(g["inputs"]) == (ctx.q, ctx.k, ctx.v) and g["deterministic"] is True
    assert ctx.row_max is None and ctx.row_sum is None  # nothing for lowrank's tape
    if GPU.standin:  # on CuPy's current stream, for the forward and for the backward
        assert call["stream"] is not None and call["stream"].ptr == stream_ptr != 0
        assert g["stream"] is call["stream"]
        assert rec.streams == [(stream_ptr, cupy.cuda.Device().id)]  # one ExternalStream, kept


def test_nondeterministic_leaves_the_flag_alone(rec):
    import cupy

    q, k, v, do = (cupy.asarray(a) for a in _inputs(1, 5, 2, 1, 64, seed=1))
    backend = attention_torch.TorchAttention(deterministic=False)
    assert backend.deterministic is False
    o, ctx = backend.forward(q, k, v)
    backend.backward(do, ctx)
    assert rec.sdpa[0]["deterministic"] is False and rec.grads[0]["deterministic"] is False


def test_refused_shapes_fail_in_one_line(rec):
    import cupy

    q, k, v, _ = (cupy.asarray(a) for a in _inputs(1, 4, 3, 2, 64, seed=2))
    with pytest.raises(ValueError, match="multiple of Hkv"):
        attention_torch.TorchAttention().forward(q, k, v)
    assert not rec.sdpa


def test_runtime_mismatch_and_problem(monkeypatch):
    mismatch = attention_torch.runtime_mismatch
    assert mismatch("13.0", None, False, 13000) is None
    assert mismatch("12.8", None, False, 12040) is None
    assert "built for CUDA 12.8, CuPy runs on CUDA 13" in mismatch("12.8", None, False, 13000)
    assert mismatch(None, "6.4.43482-0f2d60242", True, 60443482) is None
    assert "built for ROCm 6.4.43482-0f2d60242, CuPy runs on ROCm 7" in mismatch(None, "6.4.43482-0f2d60242", True, 70000000)
    assert "built for CUDA 13.0, CuPy runs on ROCm 6" in mismatch("13.0", None, True, 60443482)
    assert "built for CPU only" in mismatch(None, None, False, 13000)

    assert "runs bfloat16, not float32" in attention_torch.problem(np.float32)
    if not GPU.standin:
        return
    import cupy

    version = cupy.cuda.runtime.runtimeGetVersion()  # the stand-in's CUDA release
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None)
    assert "CPU only" in attention_torch.problem("bfloat16")
    monkeypatch.setattr(torch.version, "cuda", f"{version // 1000}.{version % 1000 // 10}")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "torch.cuda.is_available() is False" in attention_torch.problem("bfloat16")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert attention_torch.problem("bfloat16") is None
    monkeypatch.setitem(sys.modules, "torch", None)  # not installed
    assert attention_torch.problem("bfloat16").startswith("PyTorch is not installed")


# ------------------------------------------------------------------ torch 2.11's API
def _api():
    """name -> parameters (an ast.arguments) or None for an attribute, from the list file."""
    out = {}
    for line in API_LIST.read_text().splitlines():
        line = line.split("  #")[0].strip()
        if not line or line.startswith("#"):
            continue
        name, paren, params = line.partition("(")
        out[name] = ast.parse(f"def f({params}: pass").body[0].args if paren else None
    return out


def _dotted(node):
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id] + parts[::-1]) if isinstance(node, ast.Name) else None


def _check_call(call, params, name):
    names = {a.arg for a in params.posonlyargs + params.args + params.kwonlyargs}
    positional = len(params.posonlyargs + params.args)
    assert params.vararg or len(call.args) <= positional, f"{name}: {len(call.args)} positional arguments"
    for kw in call.keywords:
        assert kw.arg in names or params.kwarg, f"{name} has no keyword {kw.arg!r} in torch 2.11"


def test_every_torch_name_the_module_uses_is_in_torch_2_11():
    api = _api()
    methods = {n.split(".", 1)[1]: p for n, p in api.items() if n.startswith("Tensor.")}
    tree = ast.parse(MODULE.read_text())
    called = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    seen = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            name = _dotted(node.func)
            if name and name.startswith("torch."):
                assert name in api, f"{name} is not in {API_LIST.name}"
                assert api[name] is not None, f"{name} is an attribute, not a call"
                _check_call(node, api[name], name)
                seen.add(name)
            elif node.func.attr in methods:
                _check_call(node, methods[node.func.attr], "Tensor." + node.func.attr)
        elif isinstance(node, ast.Attribute) and id(node) not in called:
            name = _dotted(node)
            if name and name.startswith("torch."):  # an attribute read, or a prefix of a longer name
                assert name in api or any(k.startswith(name + ".") for k in api), f"{name} is not in {API_LIST.name}"
                seen.add(name)
    unused = {n for n in api if n.startswith("torch.")} - seen
    assert not unused, f"{API_LIST.name} lists names the module does not use: {sorted(unused)}"


def test_the_list_agrees_with_the_installed_torch_where_it_can_tell():
    """Catches a mistyped line: each listed Python function's parameters, read from the installed
    torch (newer than 2.11; only names the list has must exist there)."""
    for name, params in _api().items():
        obj = torch
        if name.startswith("Tensor."):
            assert hasattr(torch.Tensor, name.split(".", 1)[1]), name
            continue
        for part in name.split(".")[1:]:
            obj = getattr(obj, part)
        if params is None or not inspect.isfunction(obj):
            continue
        have = set(inspect.signature(obj).parameters)
        listed = {a.arg for a in params.posonlyargs + params.args + params.kwonlyargs}
        assert listed <= have, f"{name}: {sorted(listed - have)} not parameters of the installed torch"


def test_the_module_calls_only_listed_tensor_methods(rec):
    """The Tensor methods the module calls while running, seen by a profiler, are all in the list."""
    import cupy

    methods = {n.split(".", 1)[1] for n in _api() if n.startswith("Tensor.")}
    calls = set()

    def profile(frame, event, arg):
        if event == "c_call" and frame.f_code.co_filename == str(MODULE) and isinstance(getattr(arg, "__self__", None), torch.Tensor):
            calls.add(arg.__name__)

    q, k, v, do = (cupy.asarray(a) for a in _inputs(1, 6, 2, 1, 64, seed=3))
    backend = attention_torch.TorchAttention()
    sys.setprofile(profile)
    try:
        o, ctx = backend.forward(q, k, v)
        backend.backward(do, ctx)
    finally:
        sys.setprofile(None)
    assert calls and calls <= methods, f"Tensor methods not in {API_LIST.name}: {sorted(calls - methods)}"


def test_the_gpu_check_script_passes_its_own_checks_here(rec, monkeypatch):
    """bench/torch_attention_check.py's checks (error against the float32 math kernel, zero-copy
    inputs, bitwise-repeatable passes) on one small shape; timing needs a device clock, so its timer
    only calls the function here."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("torch_attention_check", MODULE.parents[2] / "bench" / "torch_attention_check.py")
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    monkeypatch.setattr(check, "gpu_time", lambda fn, repeats: (fn(), 1e-3)[1])
    row = check.check_shape((2, 32, 4, 2, 64), repeats=1)
    assert row["failures"] == [] and row["error"] < check.TOLERANCE and row["deterministic"]
    assert row["zero_copy"].startswith("in yes") and row["det_fwd"] == 1.0


# svd with lowrank in the default run (SDPA's forward run again by the recompute); the others with the slow tests
@pytest.mark.parametrize("arch, recompute", [pytest.param("cola", "none", marks=pytest.mark.slow), ("svd", "lowrank"),
                                             pytest.param("full", "selective", marks=pytest.mark.slow)])
def test_gpu_step_with_torch_attention_equals_the_cpu_path(rec, monkeypatch, arch, recompute):
    """A whole bf16 training step with train.attention = torch (chosen at start-up like any backend)
    equals the CPU path within test_gpu's tolerances; lowrank's recompute runs SDPA's forward again."""
    import cupy
    from tests.support.gpu_steps import step
    from tests.integration.gpu.test_gpu import assert_step_close, cpu_step

    from boostmpi.gpu import attention

    if GPU.standin:  # the CPU wheel names no CUDA: it is taken as built for the stand-in's CUDA
        version = cupy.cuda.runtime.runtimeGetVersion()
        monkeypatch.setattr(torch.version, "cuda", f"{version // 1000}.{version % 1000 // 10}")
    got = step(arch, "gpu", "bfloat16", train=dict(recompute=recompute, attention="torch"))
    assert attention.current().name == "torch" and rec.sdpa and rec.grads
    assert all(not call["math"] for call in rec.sdpa)
    assert_step_close(got, cpu_step(arch), "bfloat16", f"{arch} recompute={recompute} train.attention=torch")


def test_a_cpu_wheel_is_refused_without_importing_pytorch():
    """`auto` asks the torch backend at every GPU start-up; with PyPI's CPU wheel ("+cpu") the answer is
    known from the installed version, without the seconds an import of PyTorch takes in every rank."""
    import importlib.metadata
    import os
    import subprocess

    if not importlib.metadata.version("torch").endswith("+cpu"):
        pytest.skip("the installed PyTorch is not a CPU wheel")
    code = ("import sys\nfrom boostmpi.gpu import attention_torch as a\n"
            "print(a.problem('bfloat16'))\nprint('torch' in sys.modules)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(STANDIN),
                                                         os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120).stdout
    assert out.splitlines() == [attention_torch.runtime_mismatch(None, None, False, 12090), "False"], out
