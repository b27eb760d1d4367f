"""The `torch` attention backend: PyTorch's fused scaled-dot-product attention on CuPy's arrays.

What runs. `torch.nn.functional.scaled_dot_product_attention` on zero-copy DLPack views of the CuPy
arrays (`torch.from_dlpack`), transposed to [B, H, T, Dh] as views (no copy), causal, softmax scale
1/sqrt(Dh), `enable_gqa=True` (K and V keep their Hkv heads: nothing is repeated), with the flash,
memory-efficient and cuDNN kernels allowed and the math kernel (which builds the T x T scores) not, so
it is never chosen: a shape none of the three takes fails loudly instead of running slowly. That is
what `torch.nn.attention.sdpa_kernel([FLASH_ATTENTION, EFFICIENT_ATTENTION, CUDNN_ATTENTION])` does;
it is done here with the four `torch.backends.cuda.*_sdp` flags directly, only those that differ set
and then restored, since sdpa_kernel sets every backend's flag on entry and again on exit: 185 µs of
host time a call on this project's 2-core test machine against about 6 µs this way (bench/log/attention.md,
"Host time of the kernel restriction"). On ROCm the same call reaches PyTorch's own flash and
memory-efficient attention (AOTriton, gfx90a included). The kernels run on CuPy's current stream:
`torch.cuda.ExternalStream` wraps its handle and `torch.cuda.stream` makes it PyTorch's current
stream for the call, so no synchronisation is needed between the two libraries. Results go back with
`cupy.from_dlpack` (no copy, no host round-trip), C-contiguous in q's dtype.

The backward. PyTorch has no public call that returns the log-sum-exp of the forward, nor one that
runs the backward from it. So the forward runs with q, k, v as leaf tensors that require grad, the
context keeps the output's autograd graph, and the backward is `torch.autograd.grad` on that graph:
PyTorch's own fused backward, with no second forward and no private aten operator.

What the context holds, and what that means for `[train] recompute`. The graph keeps q, k, v (views
of the CuPy inputs, which stay alive through their DLPack capsules), the output, and the kernel's
own float32 log-sum-exp [B, H, T] plus its random-number state, all inside PyTorch: `alloc` cannot
place the log-sum-exp (it is made by PyTorch's caching allocator, not CuPy's pools) and is ignored.
Because nothing can run the backward from a statistic alone, the context exposes `row_max` and
`row_sum` as None: under recompute = "lowrank" the tape keeps no attention statistic for this backend
(the recompute runs the attention forward again, one SDPA forward per layer, and its graph lives
only until that layer's backward); recompute = "selective" keeps q, k, v as with every backend and
likewise runs the forward again; "none" and "layer" keep the graph from forward to backward:
about the same bytes as the own kernels' cache (inputs, output, one float32 statistic per row).

Determinism. PyTorch's attention backward is deterministic only under
`torch.use_deterministic_algorithms(True)`: the flash backward then runs its deterministic variant,
the memory-efficient backward splits no key blocks, and the cuDNN kernel is not chosen (PyTorch
treats it as nondeterministic; PyTorch's aten/src/ATen/native/transformers/cuda/attention_backward.cu,
`_flash_attention_backward` and `_efficient_attention_backward`, and sdp_utils.cpp,
`check_cudnn_deterministic`). `TorchAttention(deterministic=True)`, the default, turns the flag on
around its own calls only (restored after each, so nothing else in the process changes) and says
`deterministic = True`: a resumed run is then bitwise the uninterrupted one on the same GPU model,
PyTorch build and shapes. `deterministic=False` leaves the flag as the process has it (cuDNN's kernel
may then be picked; the backward may differ in the last bits run to run).

Two allocators. PyTorch's caching allocator holds what SDPA makes (outputs, gradients, the
log-sum-exp) beside CuPy's pools; each keeps freed memory for itself. `bench/torch_allocators.py`
measures what that costs. Routing PyTorch's allocations through CuPy's pool would need
`torch.cuda.memory.CUDAPluggableAllocator`, which takes a compiled shared library's malloc/free
symbols, not Python callables: it is not offered here.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import math
import sys
from collections.abc import Iterator
from types import ModuleType
from typing import TYPE_CHECKING, NamedTuple, cast

import numpy.typing as npt

from boostmpi.arrays import Alloc, Array
from boostmpi.gpu.attention import AttentionContext, DeviceInfo

if TYPE_CHECKING:  # the type check's view of PyTorch (never imported here at run time)
    import torch
    from torch import Tensor

INSTALL_HINT = "pip install torch built for the CUDA or ROCm release CuPy uses"


def _dtype_name(dtype: npt.DTypeLike) -> str:
    if isinstance(dtype, str):
        return dtype
    import numpy as np

    return np.dtype(dtype).name


def runtime_major(version: int, is_hip: bool) -> int:
    """The major release of CuPy's runtime from `cupy.cuda.runtime.runtimeGetVersion()`: CUDA
    encodes 1000 * major + 10 * minor (13000 is 13.0), HIP 10**7 * major + 10**5 * minor + patch."""
    return int(version) // (10_000_000 if is_hip else 1000)


def runtime_mismatch(torch_cuda: str | None, torch_hip: str | None, cupy_is_hip: bool, cupy_version: int) -> str | None:
    """Why PyTorch's GPU runtime does not match CuPy's (None when it does). `torch_cuda` and
    `torch_hip` are `torch.version.cuda` and `torch.version.hip` ("13.0", "6.4.43482-..." or None)."""
    cupy_major = runtime_major(cupy_version, cupy_is_hip)
    cupy_name = f"{'ROCm' if cupy_is_hip else 'CUDA'} {cupy_major}"
    torch_version = torch_hip if cupy_is_hip else torch_cuda
    if torch_version is None:
        built = f"ROCm {torch_hip}" if torch_hip else f"CUDA {torch_cuda}" if torch_cuda else "CPU only"
        return f"PyTorch is built for {built}, CuPy runs on {cupy_name} ({INSTALL_HINT})"
    torch_major = int(str(torch_version).split(".")[0])
    if torch_major != cupy_major:
        return (f"PyTorch is built for {'ROCm' if cupy_is_hip else 'CUDA'} {torch_version}, CuPy runs on "
                f"{cupy_name} ({INSTALL_HINT})")
    return None


def _wheel_local_version() -> str | None:
    """The local part of the installed torch distribution's version ("cpu", "cu130", ""), or None."""
    try:
        return importlib.metadata.version("torch").partition("+")[2]
    except importlib.metadata.PackageNotFoundError:
        return None


def problem(dtype: npt.DTypeLike, device_info: DeviceInfo | None = None) -> str | None:
    """Why the torch backend cannot run attention of `dtype` here, in one line; None when it can.
    PyTorch itself is asked about the GPU (`device_info` is not needed)."""
    name = _dtype_name(dtype)
    if name != "bfloat16":
        return f"the torch attention backend runs bfloat16, not {name}"
    if "torch" not in sys.modules and _wheel_local_version() == "cpu":
        # PyPI's CPU wheels say so in their version ("2.13.0+cpu"): known without importing PyTorch (seconds)
        import cupy

        return runtime_mismatch(None, None, cupy.cuda.runtime.is_hip, cupy.cuda.runtime.runtimeGetVersion())
    try:
        import torch
    except ImportError:
        return f"PyTorch is not installed ({INSTALL_HINT})"
    import cupy

    runtime = cupy.cuda.runtime
    mismatch = runtime_mismatch(torch.version.cuda, torch.version.hip, runtime.is_hip, runtime.runtimeGetVersion())
    if mismatch is not None:
        return mismatch
    if not torch.cuda.is_available():
        return f"PyTorch {torch.__version__} reaches no GPU (torch.cuda.is_available() is False)"
    return None


class TorchAttentionContext(NamedTuple):
    """What the torch backend's backward needs: the forward's autograd graph, reached from its
    output, and the leaf tensors it differentiates for."""
    q: Tensor  # torch leaf tensors [B, T, H, Dh] / [B, T, Hkv, Dh], views of the CuPy inputs
    k: Tensor
    v: Tensor
    out: Tensor  # SDPA's output [B, H, T, Dh], the root of the graph

    # recompute = "lowrank" keeps these: nothing, since no public PyTorch call runs the backward
    # from a statistic (the module docstring says what that costs)
    @property
    def row_max(self) -> None:
        return None

    @property
    def row_sum(self) -> None:
        return None


@contextlib.contextmanager
def _fused_kernels_only(torch: ModuleType) -> Iterator[None]:
    """SDPA's flash, memory-efficient and cuDNN kernels on and its math kernel off for the call (the
    effect of sdpa_kernel([FLASH_ATTENTION, EFFICIENT_ATTENTION, CUDNN_ATTENTION])); each flag that had
    to change is set back after."""
    flags = ((torch.backends.cuda.math_sdp_enabled, torch.backends.cuda.enable_math_sdp, False),
             (torch.backends.cuda.flash_sdp_enabled, torch.backends.cuda.enable_flash_sdp, True),
             (torch.backends.cuda.mem_efficient_sdp_enabled, torch.backends.cuda.enable_mem_efficient_sdp, True),
             (torch.backends.cuda.cudnn_sdp_enabled, torch.backends.cuda.enable_cudnn_sdp, True))
    changed = []
    for enabled, enable, wanted in flags:
        if enabled() != wanted:
            enable(wanted)
            changed.append((enable, not wanted))
    try:
        yield
    finally:
        for enable, was in changed:
            enable(was)


class TorchAttention:
    """The attention backend on PyTorch's SDPA (see the module docstring)."""

    name = "torch"

    def __init__(self, deterministic: bool = True) -> None:
        self.deterministic = bool(deterministic)
        # (CuPy stream handle, device) -> torch.cuda.ExternalStream
        self._streams: dict[tuple[int, int], torch.cuda.ExternalStream] = {}

    @contextlib.contextmanager
    def _call(self) -> Iterator[tuple[ModuleType, ModuleType]]:
        """PyTorch on CuPy's current stream (and, when deterministic, with deterministic algorithms)."""
        import cupy
        import torch

        key = (cupy.cuda.get_current_stream().ptr, cupy.cuda.Device().id)
        stream = self._streams.get(key)
        if stream is None:
            stream = self._streams[key] = torch.cuda.ExternalStream(key[0], device=key[1])
        with torch.cuda.stream(stream), self._determinism(torch):
            yield torch, cupy

    @contextlib.contextmanager
    def _determinism(self, torch: ModuleType) -> Iterator[None]:
        if not self.deterministic:
            yield
            return
        was = torch.are_deterministic_algorithms_enabled()
        warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
        torch.use_deterministic_algorithms(True)
        try:
            yield
        finally:
            torch.use_deterministic_algorithms(was, warn_only=warn_only)

    def forward(self, q: Array, k: Array, v: Array, alloc: Alloc | None = None) -> tuple[Array, AttentionContext]:
        """q [B, T, H, Dh], k, v [B, T, Hkv, Dh] (CuPy, bfloat16, C-contiguous) -> (o [B, T, H, Dh],
        TorchAttentionContext). `alloc` is not used: PyTorch allocates what its graph keeps."""
        B, T, H, Dh = q.shape
        Hkv = k.shape[2]
        if k.shape != (B, T, Hkv, Dh) or v.shape != k.shape or H % Hkv or not q.dtype == k.dtype == v.dtype:
            raise ValueError(f"attention takes q [B,T,H,Dh], k, v [B,T,Hkv,Dh] of one dtype with H a multiple of "
                             f"Hkv; got {q.shape}, {k.shape}, {v.shape}")
        with self._call() as (torch, cupy):
            qt, kt, vt = (torch.from_dlpack(a).requires_grad_(True) for a in (q, k, v))
            try:
                with _fused_kernels_only(torch):
                    out = torch.nn.functional.scaled_dot_product_attention(
                        qt.transpose(1, 2), kt.transpose(1, 2), vt.transpose(1, 2),
                        is_causal=True, scale=1.0 / math.sqrt(Dh), enable_gqa=True)
            except RuntimeError as e:
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise RuntimeError(f"PyTorch's flash, memory-efficient and cuDNN attention all refuse B={B} T={T} "
                                   f"H={H} Hkv={Hkv} Dh={Dh} {q.dtype} ({first}); train.attention = \"own\" "
                                   "runs it") from e
            o = cupy.from_dlpack(out.detach().transpose(1, 2).contiguous())
        return o, TorchAttentionContext(qt, kt, vt, out)

    def backward(self, do: Array, ctx: AttentionContext) -> tuple[Array, Array, Array]:
        """do [B, T, H, Dh] (CuPy, q's dtype) -> dq [B, T, H, Dh], dk, dv [B, T, Hkv, Dh]: PyTorch's
        backward on the forward's graph (which it frees)."""
        ctx = cast(TorchAttentionContext, ctx)  # this backend's own context
        with self._call() as (torch, cupy):
            grad_out = torch.from_dlpack(do).transpose(1, 2)
            grads = torch.autograd.grad(ctx.out, (ctx.q, ctx.k, ctx.v), grad_outputs=grad_out)
            dq, dk, dv = (cupy.from_dlpack(g.contiguous()) for g in grads)
            return dq, dk, dv
