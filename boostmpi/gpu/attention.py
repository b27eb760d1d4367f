"""The attention backends of the GPU path and the choice between them (`train.attention`).

A backend runs causal attention with grouped key/value heads on CuPy arrays: q [B,T,H,Dh], k, v
[B,T,Hkv,Dh] (C-contiguous, one dtype; K and V are never repeated to H heads) -> o [B,T,H,Dh] and a
context its backward reads; backward(dO, context) -> dq, dk, dv. The softmax scale is 1/sqrt(Dh).

- "own": the kernels of kernels/attention.cu (boostmpi.gpu.kernels), float32 or bfloat16, any GPU
  CuPy runs on; deterministic. Its context is `boostmpi.model.layers.FusedAttentionCache`.
- "cudnn": cuDNN's fused attention through its Python frontend (boostmpi/gpu/attention_cudnn.py),
  bfloat16 on NVIDIA GPUs of compute capability 8.0 or later.
- "torch": PyTorch's scaled-dot-product attention on views of the CuPy arrays
  (boostmpi/gpu/attention_torch.py).
- "auto": cudnn where it runs this run's shape, else torch where it runs, else own (one line saying
  what that costs and which package would fix it).

The choice is made once at start-up, after the rank's device is set (boostmpi.parallel.startup), and
installed with `use`; `boostmpi.model.layers.attention_forward/backward` send CuPy inputs to
`current()`. The CPU path (NumPy) never comes here.

`AttentionBackend` declares a backend and `AttentionContext` what every context offers its callers
(the recompute policies keep `row_max` and `row_sum`); the type check holds OwnAttention,
CudnnAttention and TorchAttention to them.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import TYPE_CHECKING, Protocol, TextIO, TypedDict, cast

import numpy.typing as npt

from boostmpi.arrays import Alloc, Array

BACKENDS = ("auto", "cudnn", "torch", "own")  # the values of train.attention
LIBRARY_BACKENDS = ("cudnn", "torch")

# What falling back to the own kernels costs, measured (bench/log/attention.md, 2026-11 entry: one
# H200, CUDA 13, cuDNN 9.19): B 4, T 4096, H 32, Dh 128, bfloat16, causal.
COSTLY_FALLBACK = ("attention runs on the own kernels: measured 67.0 / 132.1 ms forward / backward against "
                   "cuDNN's 0.94 / 2.81 ms at B4 T4096 H32 Dh128 bf16 on an H200 (bench/log/attention.md); "
                   "install boostmpi[cudnn] (CUDA 12) or boostmpi[cudnn-cuda13] (CUDA 13), or PyTorch with "
                   "the GPU runtime CuPy uses, for library attention")


class DeviceInfo(TypedDict):
    """The device a library backend is asked about (`_device_info`)."""
    vendor: str  # "nvidia" | "amd"
    capability: int | None  # compute capability major*10+minor; None on AMD
    device: int  # CuPy's device id


class BackendUnavailable(RuntimeError):
    """A backend that cannot run here; the message is one line that says why."""


class AttentionContext(Protocol):
    """What a backend's forward hands its backward (each backend's own NamedTuple), as others read it."""

    @property
    def q(self) -> Array:
        """The forward's q [B,T,H,Dh] (or the backend's view of it): its shape is the call's."""
        ...

    @property
    def row_max(self) -> Array | None:
        """The softmax statistic per head and token that recompute = "lowrank" keeps, or None."""
        ...

    @property
    def row_sum(self) -> Array | None:
        """The second statistic (None where the first, a log-sum-exp, is all)."""
        ...


class AttentionBackend(Protocol):
    name: str  # "cudnn" | "torch" | "own"
    deterministic: bool  # whether backward is bitwise reproducible run to run

    def forward(self, q: Array, k: Array, v: Array, alloc: Alloc | None = None) -> tuple[Array, AttentionContext]:
        """q [B,T,H,Dh], k, v [B,T,Hkv,Dh] -> (o [B,T,H,Dh], context). `alloc(shape, dtype)`, when given,
        allocates the float32 statistic the context keeps."""
        ...

    def backward(self, do: Array, ctx: AttentionContext) -> tuple[Array, Array, Array]:
        """do [B,T,H,Dh] and this backend's context -> (dq [B,T,H,Dh], dk, dv [B,T,Hkv,Dh])."""
        ...


class OwnAttention:
    """The kernels of kernels/attention.cu (the tensor-core or the FMA variant, as
    boostmpi.gpu.tensor_cores chooses); every dQ, dK and dV element is summed in one fixed order, so
    the backward is bitwise reproducible."""

    name = "own"
    deterministic = True

    def forward(self, q: Array, k: Array, v: Array, alloc: Alloc | None = None) -> tuple[Array, AttentionContext]:
        from boostmpi.gpu import kernels
        from boostmpi.model.layers import FusedAttentionCache

        o, lse = kernels.attention_forward(q, k, v, alloc=alloc)
        return o, FusedAttentionCache(q, k, v, o, lse)

    def backward(self, do: Array, ctx: AttentionContext) -> tuple[Array, Array, Array]:
        from boostmpi.gpu import kernels
        from boostmpi.model.layers import FusedAttentionCache

        ctx = cast(FusedAttentionCache, ctx)  # this backend's own context
        dq, dk, dv = kernels.attention_backward(do, ctx.q, ctx.k, ctx.v, ctx.out, ctx.lse)
        return dq, dk, dv


if TYPE_CHECKING:  # the type check holds every backend to the protocol
    from boostmpi.gpu.attention_cudnn import CudnnAttention
    from boostmpi.gpu.attention_torch import TorchAttention

    _IMPLEMENTATIONS: tuple[type[AttentionBackend], ...] = (OwnAttention, CudnnAttention, TorchAttention)


def _library_module(name: str) -> ModuleType:
    """attention_cudnn or attention_torch, imported when asked for (BackendUnavailable when the module
    itself is not there: the frontend's and PyTorch's imports happen inside the module's `problem`)."""
    import importlib

    try:
        return importlib.import_module(f"boostmpi.gpu.attention_{name}")
    except ImportError as e:
        raise BackendUnavailable(f"{name} attention backend unavailable: {e}") from None


def _device_info() -> DeviceInfo:
    """(vendor, compute capability major*10+minor or None, device id) of CuPy's current device."""
    import cupy

    device = cupy.cuda.Device()
    if getattr(cupy.cuda.runtime, "is_hip", False):
        return {"vendor": "amd", "capability": None, "device": device.id}
    return {"vendor": "nvidia", "capability": int(device.compute_capability), "device": device.id}


def _problem(name: str, dtype: str, shape: tuple[int, ...] | None = None) -> str | None:
    """Why backend `name` cannot run attention of `dtype` (and, for cudnn, of `shape`) here, or None."""
    if name == "own":
        return None
    module = _library_module(name)
    problem: str | None = module.problem(dtype, _device_info())
    if problem is None and shape is not None and hasattr(module, "shape_problem"):
        problem = module.shape_problem(dtype, shape)
    return problem


def make(name: str, dtype: str = "bfloat16", shape: tuple[int, ...] | None = None,
         deterministic: bool = True) -> AttentionBackend:
    """The backend `name` ("cudnn" | "torch" | "own"); BackendUnavailable (one line) when it cannot run
    `dtype` (and `shape` = (B, T, H, Hkv, Dh), when given) here. `deterministic=False` lets a library
    backend run its faster backward whose summation order may change run to run (own is always
    deterministic)."""
    if name not in BACKENDS[1:]:
        raise BackendUnavailable(f"unknown attention backend {name!r}: one of {', '.join(BACKENDS[1:])}")
    if name == "own":
        return OwnAttention()
    problem = _problem(name, dtype, shape)
    if problem is not None:
        raise BackendUnavailable(f"train.attention = {name} cannot run here: {problem}")
    module = _library_module(name)
    backend: AttentionBackend = (module.CudnnAttention if name == "cudnn" else module.TorchAttention)(
        deterministic=deterministic)
    return backend


def select(setting: str, dtype: npt.DTypeLike, shape: tuple[int, ...] | None = None,
           out: TextIO | None = None, deterministic: bool = True) -> AttentionBackend:
    """The backend `setting` (a value of BACKENDS) names for attention of `dtype` (a NumPy dtype or its
    name) on the current device. "auto": cudnn for bfloat16 on NVIDIA sm_80+ when a handle is made and
    a graph of `shape` = (B, T, H, Hkv, Dh) passes check_support, else torch when it can run, else own,
    with ONE line on `out` (stderr by default) naming the measured cost and the package that fixes it.
    A named backend that cannot run raises BackendUnavailable. `deterministic` as in `make`."""
    import numpy as np

    dtype = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    if setting not in BACKENDS:
        raise BackendUnavailable(f"train.attention = {setting!r}: one of {', '.join(BACKENDS)}")
    if setting != "auto":
        return make(setting, dtype, shape, deterministic)
    reasons = []
    for name in LIBRARY_BACKENDS:
        try:
            return make(name, dtype, shape, deterministic)
        except BackendUnavailable as e:
            reasons.append(str(e).replace("train.attention = ", ""))
    print(f"boostmpi: {COSTLY_FALLBACK} ({'; '.join(reasons)})", file=out or sys.stderr)
    return OwnAttention()


_current: AttentionBackend = OwnAttention()


def use(backend: AttentionBackend) -> AttentionBackend:
    """Make `backend` the one boostmpi.model.layers sends CuPy attention to (in this process)."""
    global _current
    _current = backend
    return backend


def current() -> AttentionBackend:
    """The process-wide attention backend (own until `use` says otherwise)."""
    return _current
