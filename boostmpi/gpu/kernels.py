"""The CUDA kernels of `kernels/*.cu` on CuPy: a memoised loader and one wrapper per kernel.

Each wrapper takes C-contiguous CuPy arrays of float32 or bfloat16 (`ml_dtypes.bfloat16`, which
CuPy >= 14 stores natively) and returns new arrays. The model calls them from the functions of
the same name in `boostmpi.model.layers` (and the vocabulary-parallel head), whose NumPy code is the
CPU path and the one specification each kernel is tested against (tests/kernels/test_kernels.py): the
kernels compute in float32 and round their big outputs once to the storage dtype.
Importing this module needs no CuPy; calling a wrapper does. The tile sizes, blocks and grids are
`boostmpi.gpu.launch_plan`'s: each kernel file is compiled with its plan's sizes as -D options
(`compile_options`) and launched with the same plan's geometry.

Where the sources are: $BOOSTMPI_KERNELS_DIR if set; else `boostmpi/gpu/cuda/` in an installed
wheel (the build copies the project's top-level `kernels/` folder there); else `kernels/` beside
the `boostmpi` package in a checkout (and an editable install).
"""

import functools
import math
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import NamedTuple, Protocol

import numpy as np
from numpy.typing import DTypeLike

from boostmpi.arrays import Array
from boostmpi.gpu import launch_plan, tensor_cores
from boostmpi.gpu.arguments import check as _check
from boostmpi.gpu.arguments import check_contiguous as _check_contiguous
from boostmpi.gpu.arguments import check_elementwise as _check_elementwise
from boostmpi.gpu.arguments import check_matrix as _check_matrix
from boostmpi.gpu.arguments import storage_suffix as _storage_suffix
# the launch geometry (boostmpi.gpu.launch_plan), here too for the wrappers' callers and the tests
from boostmpi.gpu.launch_plan import (COMPILE_OPTIONS, DEFAULT_DYNAMIC_SHARED_BYTES, ELEMENTWISE_BLOCK_THREADS,  # noqa: F401
                                      MAX_BLOCK_THREADS, compile_options, dw_accumulate_launch,
                                      rmsnorm_backward_launch, rmsnorm_forward_threads)
from boostmpi.gpu.launch_plan import elementwise_grid as _elementwise_grid
from boostmpi.gpu.launch_plan import row_block as _row_block

Alloc = Callable[[tuple[int, ...], DTypeLike], Array]  # alloc(shape, dtype) -> a new array


class RawKernel(Protocol):
    """What the wrappers use of a cupy.RawKernel (an entry point of a compiled module)."""

    name: str

    def __call__(self, grid: tuple[int, ...], block: tuple[int, ...], args: Sequence[object], *,
                 shared_mem: int = 0) -> None: ...


class RawModule(Protocol):
    """What the loader uses of a cupy.RawModule (one compiled kernels/*.cu)."""

    def compile(self) -> None: ...

    def get_function(self, name: str) -> RawKernel: ...


KERNELS_DIR_ENV = "BOOSTMPI_KERNELS_DIR"

_LOCAL_INCLUDE = re.compile(r'^#include "([\w.]+)"[ \t]*$', re.MULTILINE)


def kernels_dir() -> Path:
    """The folder holding the kernels' .cu sources (see the module docstring for the order)."""
    override = os.environ.get(KERNELS_DIR_ENV)
    if override:
        candidates = [Path(override)]
    else:
        here = Path(__file__).resolve().parent
        candidates = [here / "cuda", here.parents[1] / "kernels"]
    for directory in candidates:
        if directory.is_dir() and any(directory.glob("*.cu")):
            return directory
    raise FileNotFoundError(f"CUDA kernel sources not found in {' or '.join(map(str, candidates))}; "
                            f"set {KERNELS_DIR_ENV} to the folder holding the .cu files")


def kernel_source(name: str) -> str:
    """kernels/<name>.cu with its local `#include "..."` files pasted in.

    One self-contained text: NVRTC and hipRTC need no include path, and CuPy's kernel cache,
    which hashes the source text only, sees a change in a shared header.
    """
    directory = kernels_dir()
    return _LOCAL_INCLUDE.sub(lambda m: (directory / m.group(1)).read_text(), (directory / f"{name}.cu").read_text())


def _import_cupy() -> ModuleType:
    try:
        import cupy
    except ImportError as exc:
        raise RuntimeError(f"the GPU kernels need CuPy ({exc}); install boostmpi[gpu]") from exc
    return cupy


class _Device(NamedTuple):
    id: int
    warp_size: int  # 32 on NVIDIA, 64 on AMD CDNA
    sm_count: int
    max_shared_bytes: int  # dynamic shared memory a block may opt in to
    nvidia_major: int  # NVIDIA's compute capability major (8: A100, 9: H100); 0 on AMD


@functools.lru_cache(maxsize=None)
def _device_info(device_id: int) -> _Device:
    runtime = _import_cupy().cuda.runtime
    props = runtime.getDeviceProperties(device_id)
    return _Device(device_id, props["warpSize"], props["multiProcessorCount"],
                   props.get("sharedMemPerBlockOptin", props["sharedMemPerBlock"]),
                   0 if runtime.is_hip else props["major"])


def _current_device() -> _Device:
    return _device_info(_import_cupy().cuda.Device().id)


@functools.lru_cache(maxsize=None)
def _module(name: str, device_id: int, options: tuple[str, ...]) -> RawModule:
    """kernels/<name>.cu compiled once per process, device and set of options (`_options`: the
    device's warp width, the launch plan's sizes)."""
    module: RawModule = _import_cupy().RawModule(code=kernel_source(name), options=options)
    return module


def _options(name: str, device_id: int, wmma: bool = False) -> tuple[str, ...]:
    """compile_options for kernels/<name>.cu on device `device_id` (wmma: the attention's tensor-core
    variant, with CUDA's mma.h on the include path)."""
    options = compile_options(name, _device_info(device_id).warp_size, wmma)
    include = tensor_cores.mma_include() if wmma else None
    return options + (include,) if include else options


def compile_all(device_id: int = 0) -> list[str]:
    """Compiles every kernels/*.cu for device `device_id` as the wrappers load them (into CuPy's
    kernel cache, CUPY_CACHE_DIR), so that ranks started afterwards load instead of compiling, and the
    attention's tensor-core variant where a bfloat16 run would use it. Returns the module names, in
    order ("attention+wmma" last for that variant)."""
    names = [source.stem for source in sorted(kernels_dir().glob("*.cu"))]
    for name in names:
        _module(name, device_id, _options(name, device_id)).compile()
    if tensor_cores.use_wmma("bf16", _device_info(device_id)):
        _module("attention", device_id, _options("attention", device_id, wmma=True)).compile()
        names.append("attention+wmma")
    return names


def _kernel(module_name: str, entry_point: str, wmma: bool = False) -> RawKernel:
    device_id = _current_device().id
    return _module(module_name, device_id, _options(module_name, device_id, wmma)).get_function(entry_point)


def _launch(kernel: RawKernel, grid: int, block: int, args: Sequence[object], shared_mem: int = 0) -> None:
    cupy = _import_cupy()
    for arg in args:
        if not isinstance(arg, (cupy.ndarray, np.generic)):
            raise TypeError(f"kernel argument of type {type(arg).__name__}: arrays must be CuPy arrays, scalars NumPy scalars of the C type")
    kernel((int(grid),), (int(block),), args, shared_mem=int(shared_mem))


# ------------------------------------------------------------------------------ launch shapes


def _launch_rows(module_name: str, entry_point: str, rows: int, width: int, itemsize: int,
                 args: Sequence[object]) -> None:
    """One block per row of `width` elements."""
    if rows > 0:
        block = _row_block(width, itemsize, _current_device().warp_size)
        _launch(_kernel(module_name, entry_point), rows, block, args)


# ------------------------------------------------------------------------------ rmsnorm.cu


def rmsnorm_forward(x: Array, w: Array, eps: float) -> tuple[Array, Array]:
    """x [N,C], w [C] -> y [N,C] (x's dtype), rstd [N] (float32)."""
    N, C, suffix = _check_matrix("x", x)
    _check("w", w, (C,), x.dtype)
    cupy = _import_cupy()
    y = cupy.empty_like(x)
    rstd = cupy.empty(N, dtype=np.float32)
    if N > 0:
        threads = rmsnorm_forward_threads(C, x.itemsize, _current_device().warp_size)
        _launch(_kernel("rmsnorm", f"rmsnorm_forward_{suffix}"), N, threads, (x, w, y, rstd, np.int32(C), np.float32(eps)))
    return y, rstd


def rmsnorm_backward(dy: Array, x: Array, w: Array, rstd: Array, dw: Array | None = None) -> tuple[Array, Array | None]:
    """dy, x [N,C], w [C], rstd [N] float32 -> dx [N,C] (x's dtype), dw [C] (float32); with `dw`
    given (float32 [C]) the weight's gradient is added to it instead (and None returned for it).

    Two kernels: rmsnorm_projection (one block per row) gives each row's proj = rstd^2 *
    mean(dy * w * x); rmsnorm_backward, over column tiles x row chunks, writes dx and one dw
    partial row per chunk, which are summed here (dw_accumulate: one kernel more)."""
    N, C, suffix = _check_matrix("x", x)
    _check("dy", dy, (N, C), x.dtype)
    _check("w", w, (C,), x.dtype)
    _check("rstd", rstd, (N,), np.float32)
    cupy = _import_cupy()
    dx = cupy.empty_like(x)
    if N == 0 or C == 0:
        return dx, None if dw is not None else cupy.zeros(C, dtype=np.float32)
    proj = cupy.empty(N, dtype=np.float32)
    _launch_rows("rmsnorm", f"rmsnorm_projection_{suffix}", N, C, x.itemsize, (dy, x, w, rstd, proj, np.int32(C)))
    device = _current_device()
    threads, tiles, rows_per_chunk, chunks = rmsnorm_backward_launch(N, C, x.itemsize, device.warp_size, device.sm_count)
    dw_partial = cupy.empty((chunks, C), dtype=np.float32)
    _launch(_kernel("rmsnorm", f"rmsnorm_backward_{suffix}"), tiles * chunks, threads,
            (dy, x, w, rstd, proj, dx, dw_partial, np.int32(N), np.int32(C), np.int32(rows_per_chunk)))
    return dx, _dw_result(dw_partial, dw)


def dw_accumulate(dw_partial: Array, dw: Array) -> None:
    """dw [C] float32 += the sum over rows of dw_partial [n_chunks, C] float32, in one kernel (the
    column-tile kernels' last step)."""
    n_chunks, C = dw_partial.shape
    _check("dw_partial", dw_partial, (n_chunks, C), np.float32)
    _check("dw", dw, (C,), np.float32)
    if C:
        blocks, threads = dw_accumulate_launch(C)
        _launch(_kernel("rmsnorm", "dw_accumulate_f32"), blocks, threads, (dw_partial, dw, np.int32(n_chunks), np.int32(C)))


def _dw_result(dw_partial: Array, dw: Array | None) -> Array | None:
    """The column-tile kernels' dw: the partial rows' sum, or None once dw_accumulate added it to `dw`."""
    if dw is not None:
        dw_accumulate(dw_partial, dw)
    return dw_partial.sum(axis=0) if dw is None else None


def _empty(cupy: ModuleType) -> Alloc:
    """alloc(shape, dtype) -> a new array: what a kernel's output is made with when no `alloc` is given."""
    return lambda shape, dtype: cupy.empty(shape, dtype=dtype)


def rmsnorm_online_stats(x: Array, w: Array) -> tuple[Array, Array]:
    """This rank's shard x [N,Cs], w [Cs] -> xw [N,Cs] = x * w (x's dtype), ss [N] = sum(x^2) (float32)."""
    N, Cs, suffix = _check_matrix("x", x)
    _check("w", w, (Cs,), x.dtype)
    cupy = _import_cupy()
    xw = cupy.empty_like(x)
    ss = cupy.empty(N, dtype=np.float32)
    _launch_rows("rmsnorm", f"rmsnorm_online_stats_{suffix}", N, Cs, x.itemsize, (x, w, xw, ss, np.int32(Cs)))
    return xw, ss


def residual_online_stats(h: Array, y: Array, w: Array, copy: Array | None = None) -> tuple[Array, Array, Array]:
    """This rank's shards h, y [N,Cs], w [Cs] -> s = h + y [N,Cs], xw = s * w [N,Cs] (h's dtype),
    ss [N] = sum(s^2) (float32), from one kernel; s is also written to `copy` [N,Cs] when given."""
    N, Cs, suffix = _check_matrix("h", h)
    _check("y", y, (N, Cs), h.dtype)
    _check("w", w, (Cs,), h.dtype)
    cupy = _import_cupy()
    s, xw, ss = cupy.empty_like(h), cupy.empty_like(h), cupy.empty(N, dtype=np.float32)
    _check("copy", s if copy is None else copy, (N, Cs), h.dtype)
    _launch_rows("rmsnorm", f"residual_online_stats_{suffix}", N, Cs, h.itemsize,
                 (h, y, w, s, s if copy is None else copy, xw, ss, np.int32(Cs)))
    return s, xw, ss


def rescale_rows(P: Array, ss_total: Array, C_total: int, eps: float, alloc: Alloc | None = None) -> Array:
    """P [N,R], ss_total [N] float32 -> P * rsqrt(ss_total / C_total + eps) [N,R] (P's dtype), made
    by `alloc(shape, dtype)` when given."""
    N, R, suffix = _check_matrix("P", P)
    _check("ss_total", ss_total, (N,), np.float32)
    cupy = _import_cupy()
    out = (alloc or _empty(cupy))(P.shape, P.dtype)
    _launch_rows("rmsnorm", f"rescale_rows_{suffix}", N, R, P.itemsize,
                 (P, ss_total, out, np.int32(R), np.int32(C_total), np.float32(eps)))
    return out


# ------------------------------------------------------------------------------ btp.cu


def btp_rescale_silu(P: Array, ss_total: Array, C_total: int, eps: float,
                     alloc: Alloc | None = None) -> tuple[Array, Array, Array]:
    """P [N,R], ss_total [N] float32 -> Z = P * rstd, Zs = silu(Z) [N,R] (P's dtype) and
    rstd = rsqrt(ss_total / C_total + eps) [N] (float32), from one kernel; Z and rstd made by
    `alloc(shape, dtype)` when given (what lowrank keeps)."""
    N, R, suffix = _check_matrix("P", P)
    _check("ss_total", ss_total, (N,), np.float32)
    cupy = _import_cupy()
    keep = alloc or _empty(cupy)
    Z, Zs = keep(P.shape, P.dtype), cupy.empty_like(P)
    rstd = keep((N,), np.float32)
    _launch_rows("btp", f"btp_rescale_silu_{suffix}", N, R, P.itemsize,
                 (P, ss_total, Z, Zs, rstd, np.int32(R), np.int32(C_total), np.float32(eps)))
    return Z, Zs, rstd


def btp_backward_pre(dZs: Array, Z: Array, rstd: Array, C_total: int, act: bool) -> tuple[Array, Array]:
    """dZs, Z [N,R], rstd [N] float32 -> dP [N,R] = dZ * rstd (Z's dtype), dS [N] (float32) =
    -0.5 / C_total * rstd^2 * sum(dZ * Z), with dZ = dZs * silu'(Z) when `act`, else dZs."""
    N, R, suffix = _check_matrix("Z", Z)
    _check("dZs", dZs, (N, R), Z.dtype)
    _check("rstd", rstd, (N,), np.float32)
    cupy = _import_cupy()
    dP = cupy.empty_like(Z)
    dS = cupy.empty(N, dtype=np.float32)
    _launch_rows("btp", f"btp_backward_pre_{suffix}", N, R, Z.itemsize,
                 (dZs, Z, rstd, dP, dS, np.int32(R), np.int32(C_total), np.int32(bool(act))))
    return dP, dS


def btp_backward_post(dxw: Array, x: Array, w: Array, dS: Array, residual: Array | None = None,
                      dw: Array | None = None) -> tuple[Array, Array | None]:
    """dxw [N,Cs] float32, x [N,Cs], w [Cs], dS [N] float32 -> dx [N,Cs] = dxw * w + 2 * x * dS
    (x's dtype; plus `residual` [N,Cs] of x's dtype when given, added in float32 before the one
    rounding: the gradient from above that meets dx at the residual, with no addition kernel),
    dw [Cs] = sum over rows of dxw * x (float32), or added to `dw` when given (None returned for it).
    One kernel over rmsnorm_backward's column tiles and row chunks (no shared memory, whatever Cs),
    then the sum of its per-chunk dw rows (dw_accumulate)."""
    N, Cs, suffix = _check_matrix("x", x)
    _check("dxw", dxw, (N, Cs), np.float32)
    _check("w", w, (Cs,), x.dtype)
    _check("dS", dS, (N,), np.float32)
    if residual is not None:
        _check("residual", residual, (N, Cs), x.dtype)
    cupy = _import_cupy()
    dx = cupy.empty_like(x)
    if N == 0 or Cs == 0:
        return dx, None if dw is not None else cupy.zeros(Cs, dtype=np.float32)
    device = _current_device()
    threads, tiles, rows_per_chunk, chunks = rmsnorm_backward_launch(N, Cs, x.itemsize, device.warp_size, device.sm_count)
    dw_partial = cupy.empty((chunks, Cs), dtype=np.float32)
    _launch(_kernel("btp", f"btp_backward_post_{suffix}"), tiles * chunks, threads,
            (dxw, x, w, dS, x if residual is None else residual, dx, dw_partial, np.int32(N), np.int32(Cs),
             np.int32(rows_per_chunk), np.int32(residual is not None)))
    return dx, _dw_result(dw_partial, dw)


# ------------------------------------------------------------------------------ lowrank.cu


def _launch_elementwise(entry_point: str, n: int, itemsize: int, args: Sequence[object]) -> None:
    if n > 0:
        grid = _elementwise_grid(n, itemsize, _current_device().sm_count)
        _launch(_kernel("lowrank", entry_point), grid, ELEMENTWISE_BLOCK_THREADS, args)


def silu_forward(a: Array) -> Array:
    """z = silu(a), any shape."""
    suffix = _check_elementwise("a", a)
    z = _import_cupy().empty_like(a)
    _launch_elementwise(f"silu_forward_{suffix}", a.size, a.itemsize, (a, z, np.int64(a.size)))
    return z


def silu_backward(a: Array, dz: Array) -> Array:
    """da = dz * silu'(a)."""
    suffix = _check_elementwise("a", a, dz=dz)
    da = _import_cupy().empty_like(a)
    _launch_elementwise(f"silu_backward_{suffix}", a.size, a.itemsize, (a, dz, da, np.int64(a.size)))
    return da


def gate_forward(g: Array, u: Array, act: bool) -> Array:
    """y = (silu(g) if act else g) * u."""
    suffix = _check_elementwise("g", g, u=u)
    y = _import_cupy().empty_like(g)
    _launch_elementwise(f"gate_forward_{suffix}", g.size, g.itemsize, (g, u, y, np.int64(g.size), np.int32(bool(act))))
    return y


def gate_backward(g: Array, u: Array, dy: Array, act: bool) -> tuple[Array, Array]:
    """dg = dy * u * act'(g), du = dy * act(g), from one kernel."""
    suffix = _check_elementwise("g", g, u=u, dy=dy)
    cupy = _import_cupy()
    dg = cupy.empty_like(g)
    du = cupy.empty_like(g)
    _launch_elementwise(f"gate_backward_{suffix}", g.size, g.itemsize,
                        (g, u, dy, dg, du, np.int64(g.size), np.int32(bool(act))))
    return dg, du


# ------------------------------------------------------------------------------ softmax_xent.cu

_TARGET_SUFFIXES = {np.dtype(np.int32): "i32", np.dtype(np.int64): "i64"}


def softmax_xent(logits: Array, targets: Array, grad_scale: float | None = None,
                 out: Array | None = None) -> tuple[Array, Array | None]:
    """logits [N,V], targets [N] int32/int64 -> loss [N] float32, dlogits [N,V] or None.

    With grad_scale, dlogits = (softmax - onehot) * grad_scale is written to `out` (which may be
    `logits` itself, for in place) or to a new array; without it only the loss is computed.
    """
    N, V, suffix = _check_matrix("logits", logits)
    if targets.dtype not in _TARGET_SUFFIXES:
        raise TypeError(f"targets has dtype {targets.dtype}, expected int32 or int64")
    _check("targets", targets, (N,), targets.dtype)
    write_grad = grad_scale is not None
    if out is not None:
        if not write_grad:
            raise ValueError("softmax_xent: out is given but grad_scale is not, so there is no gradient to write")
        _check("out", out, (N, V), logits.dtype)
    cupy = _import_cupy()
    loss = cupy.empty(N, dtype=np.float32)
    dlogits = None
    if write_grad:
        dlogits = out if out is not None else cupy.empty_like(logits)
    # without a gradient the kernel never writes through its dlogits pointer; it gets logits to have one
    _launch_rows("softmax_xent", f"softmax_xent_{suffix}_{_TARGET_SUFFIXES[targets.dtype]}", N, V, logits.itemsize,
                 (logits, targets, loss, dlogits if write_grad else logits, np.int32(write_grad), np.int32(V),
                  np.float32(grad_scale if write_grad else 0.0)))
    return loss, dlogits


# ------------------------------------------------------------------------------ attention.cu
# The tiles of kernels/attention.cu (its opening comment has the plan) and of its tensor-core variant
# are launch_plan.ATTENTION's, read at each call. bfloat16 attention on NVIDIA GPUs of compute capability
# 8.0 or later runs the WMMA kernels (attention.cu with -DBOOSTMPI_ATTENTION_WMMA: attention_wmma.cuh),
# everything else the FMA kernels: boostmpi/gpu/tensor_cores.py
ATTENTION_TENSOR_CORES_ENV = tensor_cores.ENV


def attention_traffic(B: int, T: int, H: int, Hkv: int, Dh: int, itemsize: int,
                      tensor_cores: bool = False) -> dict[str, tuple[int, int]]:
    """{launch: (bytes read, bytes written)} of global memory as the kernels' tile plan moves them
    (launch_plan.AttentionPlan.traffic, on the current plan)."""
    return launch_plan.ATTENTION.traffic(B, T, H, Hkv, Dh, itemsize, tensor_cores)


def attention_head_dim_max() -> int:
    """The largest head dim the fused attention kernels take (the model computes larger ones unfused)."""
    return launch_plan.ATTENTION.head_dim_max


def _check_attention(q: Array, k: Array, v: Array) -> tuple[int, int, int, int, int, str]:
    """q [B,T,H,Dh], k, v [B,T,Hkv,Dh] of one dtype -> (B, T, H, Hkv, Dh, suffix)."""
    if q.ndim != 4:
        raise ValueError(f"q must be 4-D [B, T, H, Dh], got shape {tuple(q.shape)}")
    B, T, H, Dh = q.shape
    suffix = _storage_suffix("q", q)
    _check_contiguous("q", q)
    if k.ndim != 4 or k.shape[:2] != (B, T) or k.shape[3] != Dh:
        raise ValueError(f"k has shape {tuple(k.shape)}, expected ({B}, {T}, Hkv, {Dh})")
    Hkv = k.shape[2]
    _check("k", k, (B, T, Hkv, Dh), q.dtype)
    _check("v", v, (B, T, Hkv, Dh), q.dtype)
    if Hkv == 0 or H % Hkv:
        raise ValueError(f"{H} query heads do not form groups over {Hkv} key/value heads")
    head_dim_max = launch_plan.ATTENTION.head_dim_max
    if not 0 < Dh <= head_dim_max:
        raise ValueError(f"head dim {Dh}: the attention kernels take 1 to {head_dim_max}")
    return B, T, H, Hkv, Dh, suffix


def attention_entry(kernel: str, Dh: int, suffix: str) -> str:
    """The entry point that runs `kernel` at head dim Dh (launch_plan.AttentionPlan.entry)."""
    return launch_plan.ATTENTION.entry(kernel, Dh, suffix)


def _attention_scalars(T: int, H: int, Hkv: int, Dh: int) -> tuple[np.int32, np.int32, np.int32, np.int32, np.float32]:
    return np.int32(T), np.int32(H), np.int32(Hkv), np.int32(Dh), np.float32(1.0 / np.sqrt(Dh))


def _attention_tensor_cores(suffix: str) -> bool:
    return tensor_cores.use_wmma(suffix, _current_device())


def attention_tensor_cores_problem(suffix: str) -> str | None:
    """What stops the attention on `suffix` from running as BOOSTMPI_ATTENTION_TENSOR_CORES asks on the
    current device, or None (start-up asks before any weight is drawn)."""
    return tensor_cores.problem(suffix, _current_device())


def attention_forward(q: Array, k: Array, v: Array, alloc: Alloc | None = None) -> tuple[Array, Array]:
    """Causal attention: q [B,T,H,Dh], k, v [B,T,Hkv,Dh] -> o [B,T,H,Dh] (q's dtype), lse [B,H,T]
    (float32, the log-sum-exp of each row's scaled scores, what the backward recomputes from; made by
    `alloc(shape, dtype)` when given)."""
    B, T, H, Hkv, Dh, suffix = _check_attention(q, k, v)
    cupy = _import_cupy()
    o = cupy.empty_like(q)
    lse = (alloc or _empty(cupy))((B, H, T), np.float32)
    if B * T * H:
        plan, tc = launch_plan.ATTENTION, _attention_tensor_cores(suffix)
        kernel = "attention_forward_tc" if tc else "attention_forward"
        _launch(_kernel("attention", attention_entry(kernel, Dh, suffix), wmma=tc), B * H * -(-T // plan.query_tile),
                plan.tc_threads if tc else plan.threads, (q, k, v, o, lse, *_attention_scalars(T, H, Hkv, Dh)))
    return o, lse


def attention_backward(do: Array, q: Array, k: Array, v: Array, o: Array, lse: Array) -> tuple[Array, Array, Array]:
    """dO, q, o [B,T,H,Dh], k, v [B,T,Hkv,Dh], lse [B,H,T] float32 -> dq [B,T,H,Dh], dk, dv [B,T,Hkv,Dh].

    Two launches: dQ (and delta = rowsum(dO * O), float32 [B,H,T]) per query tile, then dK/dV
    per key tile, summed over the query heads of each group."""
    B, T, H, Hkv, Dh, suffix = _check_attention(q, k, v)
    _check("do", do, q.shape, q.dtype)
    _check("o", o, q.shape, q.dtype)
    _check("lse", lse, (B, H, T), np.float32)
    cupy = _import_cupy()
    dq, dk, dv = cupy.empty_like(q), cupy.empty_like(k), cupy.empty_like(v)
    if B * T * H:
        scalars = _attention_scalars(T, H, Hkv, Dh)
        delta = cupy.empty((B, H, T), dtype=np.float32)
        dq_args, dkdv_args = (q, k, v, o, do, lse, delta, dq, *scalars), (q, k, v, do, lse, delta, dk, dv, *scalars)
        plan, tc = launch_plan.ATTENTION, _attention_tensor_cores(suffix)
        threads, key_tile, variant = (plan.tc_threads, plan.tc_bwd_keys, "_tc") if tc else (plan.threads, plan.bwd_key_tile, "")
        _launch(_kernel("attention", attention_entry(f"attention_backward_dq{variant}", Dh, suffix), wmma=tc),
                B * H * -(-T // plan.query_tile), threads, dq_args)
        _launch(_kernel("attention", attention_entry(f"attention_backward{variant}", Dh, suffix), wmma=tc),
                B * Hkv * -(-T // key_tile), threads, dkdv_args)
    return dq, dk, dv


def _rope(entry: str, x: Array, cos: Array, sin: Array, out: Array | None = None) -> Array:
    """x [B,T,heads,Dh], cos, sin [T,1,Dh] or [T,Dh] of x's dtype -> the rotated x (or, backward, the
    gradient through the rotation), in `out` when given (x itself included: each thread reads its
    pair of elements before it writes them)."""
    if x.ndim != 4:
        raise ValueError(f"x must be 4-D [B, T, heads, Dh], got shape {tuple(x.shape)}")
    B, T, heads, Dh = x.shape
    suffix = _storage_suffix("x", x)
    _check_contiguous("x", x)
    if Dh % 2:
        raise ValueError(f"RoPE rotates pairs of dims: head dim {Dh} is odd")
    for name, table in (("cos", cos), ("sin", sin)):
        if table.size != T * Dh or table.shape[0] != T or table.shape[-1] != Dh:
            raise ValueError(f"{name} has shape {tuple(table.shape)}, expected ({T}, 1, {Dh}) for x of shape {tuple(x.shape)}")
        _check(name, table, table.shape, x.dtype)
    if out is None:
        out = _import_cupy().empty_like(x)
    else:
        _check("out", out, x.shape, x.dtype)
        _check_contiguous("out", out)
    pairs = x.size // 2
    if pairs:
        grid = launch_plan.rope_grid(pairs, _current_device().sm_count)
        _launch(_kernel("rope", f"{entry}_{suffix}"), grid, ELEMENTWISE_BLOCK_THREADS,
                (x, cos, sin, out, np.int64(pairs), np.int32(T), np.int32(heads), np.int32(Dh)))
    return out


def rope_forward(x: Array, cos: Array, sin: Array, out: Array | None = None) -> Array:
    """RoPE on x [B,T,heads,Dh] with the tables cos, sin [T,1,Dh]: one read and one write of x (into
    `out`, which may be x, when given)."""
    return _rope("rope_forward", x, cos, sin, out)


def rope_backward(dy: Array, cos: Array, sin: Array) -> Array:
    """The gradient through rope_forward: dx from dy [B,T,heads,Dh]."""
    return _rope("rope_backward", dy, cos, sin)
