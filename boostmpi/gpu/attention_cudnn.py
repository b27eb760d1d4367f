"""Attention on cuDNN's fused kernels (train.attention = "cudnn"), through nvidia-cudnn-frontend 1.28.

Why 1.28: releases from 1.29 on hard-require nvidia-cutlass-dsl and apache-tvm-ffi (about 200 MB);
1.28.0 is the newest without them, and it needs cuda-bindings to plan (the `[cudnn]` extras pin both).
Release 1.28's Python layer accepts any keyword for sdpa and sdpa_backward, so a misspelled one would
build and validate: every keyword used here is checked, in the tests, against the C++ binding's
signatures of 1.28 (tests/cudnn_calls_checked.txt).

How it runs:
- libcudnn.so.9 is loaded first with RTLD_GLOBAL from named places (`library_candidates`): the
  frontend's own search does not look where the CUDA 13 wheel puts it, and a miss would show only later
  as a failed cudnnCreate. Not found: one line listing every place tried.
- one cuDNN handle per device, made when the backend is first used on it (after start-up chose the
  rank's device); before each execute the handle is set to CuPy's current stream
  (`cudnn.set_stream(handle, stream.ptr)`; 1.28 takes the Handle object and skips an unchanged stream).
- a forward and a backward graph per shape (B, T, H, Hkv, Dh, dtype, device), built once and cached;
  `build_seconds` records what each build cost. Tensors are declared in the BHSD dim order cuDNN's SDPA
  reads, with strides over the BSHD memory the model keeps ([B, T, H, Dh], C-contiguous): no copies.
  K and V keep their Hkv heads (cuDNN's GQA). The statistic is [B, H, T, 1] float32, the natural-log
  log-sum-exp of each row's scaled scores (what recompute = "lowrank" keeps, `CudnnContext.row_max`).
- the workspace comes from CuPy's memory pool, per call.
- the backward runs cuDNN's deterministic algorithm (`use_deterministic_algorithm=True`): its dQ is
  then summed in a fixed order, so a step run twice gives the same bits and resume stays bitwise, as
  with the own kernels (docs/OPERATIONS.md). `CudnnAttention(deterministic=False)` (`train.deterministic
  = false`) builds the backward without it: faster, and resume is then not bitwise.
"""

from __future__ import annotations

import ctypes
import math
import os
import sysconfig
import time
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, NamedTuple, cast

import numpy as np

from boostmpi.arrays import Alloc, Array
from boostmpi.gpu.attention import AttentionContext, BackendUnavailable, DeviceInfo

if TYPE_CHECKING:
    import cudnn  # nvidia-cudnn-frontend (no type information): its graph, tensor and handle types

FRONTEND = "1.28"  # the release whose signatures the tests check (tests/cudnn_calls_checked.txt)
LIBRARY = "libcudnn.so.9"
DETERMINISTIC = True  # sdpa_backward's use_deterministic_algorithm (docs/GPU.md: resume stays bitwise)
INSTALL = "pip install 'boostmpi[cudnn]' (CUDA 12) or 'boostmpi[cudnn-cuda13]' (CUDA 13)"


class CudnnContext(NamedTuple):
    """What the cuDNN backward reads: the inputs as given, the output and the statistic."""
    q: Array  # [B, T, H, Dh]
    k: Array  # [B, T, Hkv, Dh]
    v: Array
    o: Array  # [B, T, H, Dh]
    stats: Array  # [B, H, T, 1] float32: log-sum-exp of each row's scaled scores

    # the softmax statistics a recompute policy keeps (recompute = "lowrank"): here the one
    @property
    def row_max(self) -> Array:
        return self.stats

    @property
    def row_sum(self) -> None:
        return None


def library_candidates(environ: Mapping[str, str] | None = None, purelib: str | None = None) -> list[str]:
    """Where libcudnn.so.9 is looked for, in order: each $LD_LIBRARY_PATH directory, the CUDA 12 wheel's
    purelib/nvidia/cudnn/lib, the CUDA 13 wheel's purelib/nvidia/cu13/lib, then the bare name (dlopen's
    own search: ldconfig's cache, the system directories)."""
    environ = os.environ if environ is None else environ
    purelib = purelib or sysconfig.get_path("purelib")
    paths = [os.path.join(d, LIBRARY) for d in environ.get("LD_LIBRARY_PATH", "").split(os.pathsep) if d]
    paths += [os.path.join(purelib, "nvidia", "cudnn", "lib", LIBRARY), os.path.join(purelib, "nvidia", "cu13", "lib", LIBRARY)]
    return paths + [LIBRARY]


# the path libcudnn was loaded from (kept loaded: RTLD_GLOBAL, for the frontend's binding)
_loaded: list[tuple[str, ctypes.CDLL]] = []


def preload(environ: Mapping[str, str] | None = None, purelib: str | None = None) -> tuple[str, ctypes.CDLL]:
    """Load libcudnn.so.9 with RTLD_GLOBAL from the first candidate that loads; BackendUnavailable (one
    line naming every candidate) when none does. Once per process."""
    if _loaded:
        return _loaded[0]
    tried = []
    for path in library_candidates(environ, purelib):
        if os.sep in path and not os.path.exists(path):
            tried.append(path)
            continue
        try:
            _loaded.append((path, ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)))
        except OSError:
            tried.append(path)
            continue
        return _loaded[0]
    raise BackendUnavailable(f"{LIBRARY} not found (tried {', '.join(tried)}): {INSTALL}")


def frontend() -> ModuleType:
    """The `cudnn` module (nvidia-cudnn-frontend), libcudnn preloaded; BackendUnavailable (one line)."""
    preload()
    try:
        import cudnn
    except ImportError as e:
        raise BackendUnavailable(f"nvidia-cudnn-frontend is not installed ({e}): {INSTALL}") from None
    version = getattr(cudnn, "__version__", "?")
    if version.rsplit(".", 1)[0] != FRONTEND:
        raise BackendUnavailable(f"nvidia-cudnn-frontend {version} is installed; boostmpi's calls are checked "
                                 f"against {FRONTEND}: {INSTALL}")
    module: ModuleType = cudnn
    return module


def problem(dtype: object, device_info: DeviceInfo) -> str | None:
    """Why cuDNN attention cannot run `dtype` on the device `device_info` describes, or None. Makes the
    device's handle (importing the frontend proves nothing: a missing libcudnn shows at cudnnCreate)."""
    if str(dtype) != "bfloat16":
        return f"cuDNN attention runs bfloat16 only (train.dtype = {dtype})"
    if device_info.get("vendor") != "nvidia":
        return f"cuDNN runs on NVIDIA GPUs only (this device: {device_info.get('vendor')})"
    if (device_info.get("capability") or 0) < 80:
        return f"cuDNN's fused attention needs compute capability 8.0 or later (this GPU: {device_info.get('capability')})"
    try:
        _handle(frontend(), device_info.get("device", 0))
    except BackendUnavailable as e:
        return str(e)
    except Exception as e:  # noqa: BLE001 - the library's own failure, said in one line
        return f"no cuDNN handle could be made: {_one_line(e)}"
    return None


def shape_problem(dtype: object, shape: Sequence[int]) -> str | None:
    """Why the forward or backward graph of `shape` = (B, T, H, Hkv, Dh) fails check_support, or None
    (the graphs built here are the ones the run will use: they stay cached)."""
    try:
        backend = CudnnAttention()
        for kind in ("forward", "backward"):
            backend._graph(kind, *shape)
    except BackendUnavailable as e:
        return str(e)
    except Exception as e:  # noqa: BLE001 - cuDNN's refusal (cudnnGraphNotSupportedError & co.), one line
        return f"cuDNN refuses B,T,H,Hkv,Dh = {tuple(shape)}: {_one_line(e)}"
    return None


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:300]}"


_handles: dict[int, cudnn.Handle] = {}  # device id -> cudnn.Handle, made on that device
# (kind, B, T, H, Hkv, Dh, dtype, device), and for a backward whether it is the deterministic one
_GraphKey = tuple[object, ...]
_graphs: dict[_GraphKey, _Graph] = {}
build_seconds: dict[_GraphKey, float] = {}  # the same keys -> seconds each graph took to build


def _handle(cudnn: ModuleType, device: int) -> cudnn.Handle:
    if device not in _handles:
        _handles[device] = cudnn.create_handle()
    return _handles[device]


def _bshd(graph: cudnn.pygraph, cudnn: ModuleType, name: str, B: int, T: int, H: int, Dh: int) -> cudnn.tensor:
    """A [B, T, H, Dh] C-contiguous array declared as cuDNN's BHSD dims with the matching strides."""
    return graph.tensor(name=name, dim=[B, H, T, Dh], stride=[T * H * Dh, Dh, H * Dh, 1],
                        data_type=cudnn.data_type.BFLOAT16)


class _Graph(NamedTuple):
    graph: cudnn.pygraph
    tensors: dict[str, cudnn.tensor]  # our name -> the graph's tensor
    workspace: int  # bytes


def _finish(graph: cudnn.pygraph, cudnn: ModuleType) -> int:
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    return int(graph.get_workspace_size())


class CudnnAttention:
    """The cuDNN backend: bfloat16, causal, scale 1/sqrt(Dh), grouped K/V heads."""

    name = "cudnn"

    def __init__(self, deterministic: bool = DETERMINISTIC) -> None:
        import cupy

        # sdpa_backward's use_deterministic_algorithm: True by default (resume stays bitwise); False lets
        # cuDNN pick its faster backward, whose dQ is summed in an order that can change run to run
        self.deterministic = bool(deterministic)

        self.cudnn = frontend()
        self.cupy = cupy
        self.device = cupy.cuda.Device().id
        self.handle = _handle(self.cudnn, self.device)

    def _graph(self, kind: str, B: int, T: int, H: int, Hkv: int, Dh: int) -> _Graph:
        key: _GraphKey = (kind, B, T, H, Hkv, Dh, "bfloat16", self.device) + ((self.deterministic,) if kind == "backward" else ())
        if key not in _graphs:
            start = time.perf_counter()
            _graphs[key] = (self._build_forward if kind == "forward" else self._build_backward)(B, T, H, Hkv, Dh)
            build_seconds[key] = time.perf_counter() - start
        return _graphs[key]

    def _new_graph(self, kind: str, B: int, T: int, H: int, Hkv: int, Dh: int,
                   ) -> tuple[cudnn.pygraph, dict[str, cudnn.tensor]]:
        cudnn = self.cudnn
        graph = cudnn.pygraph(name=f"boostmpi_attention_{kind}", io_data_type=cudnn.data_type.BFLOAT16, intermediate_data_type=cudnn.data_type.FLOAT,
                              compute_data_type=cudnn.data_type.FLOAT, handle=self.handle)
        t = {"q": _bshd(graph, cudnn, "q", B, T, H, Dh), "k": _bshd(graph, cudnn, "k", B, T, Hkv, Dh),
             "v": _bshd(graph, cudnn, "v", B, T, Hkv, Dh)}
        return graph, t

    def _build_forward(self, B: int, T: int, H: int, Hkv: int, Dh: int) -> _Graph:
        cudnn = self.cudnn
        graph, t = self._new_graph("forward", B, T, H, Hkv, Dh)
        o, stats = graph.sdpa(q=t["q"], k=t["k"], v=t["v"], generate_stats=True, attn_scale=1.0 / math.sqrt(Dh),
                              use_causal_mask=True, name="attention")
        o.set_output(True).set_dim([B, H, T, Dh]).set_stride([T * H * Dh, Dh, H * Dh, 1])
        stats.set_output(True).set_dim([B, H, T, 1]).set_stride([H * T, T, 1, 1]).set_data_type(cudnn.data_type.FLOAT)
        t.update(o=o, stats=stats)
        return _Graph(graph, t, _finish(graph, cudnn))

    def _build_backward(self, B: int, T: int, H: int, Hkv: int, Dh: int) -> _Graph:
        cudnn = self.cudnn
        graph, t = self._new_graph("backward", B, T, H, Hkv, Dh)
        t["o"] = _bshd(graph, cudnn, "o", B, T, H, Dh)
        t["do"] = _bshd(graph, cudnn, "do", B, T, H, Dh)
        t["stats"] = graph.tensor(name="stats", dim=[B, H, T, 1], stride=[H * T, T, 1, 1], data_type=cudnn.data_type.FLOAT)
        dq, dk, dv = graph.sdpa_backward(q=t["q"], k=t["k"], v=t["v"], o=t["o"], dO=t["do"], stats=t["stats"],
                                         attn_scale=1.0 / math.sqrt(Dh), use_causal_mask=True,
                                         use_deterministic_algorithm=self.deterministic, name="attention_backward")
        for name, out, heads in (("dq", dq, H), ("dk", dk, Hkv), ("dv", dv, Hkv)):
            out.set_output(True).set_dim([B, heads, T, Dh]).set_stride([T * heads * Dh, Dh, heads * Dh, 1])
            t[name] = out
        return _Graph(graph, t, _finish(graph, cudnn))

    def _execute(self, built: _Graph, arrays: dict[str, Array]) -> None:
        cupy = self.cupy
        workspace = cupy.empty(max(built.workspace, 1), dtype=np.uint8)  # CuPy's pool
        self.cudnn.set_stream(self.handle, cupy.cuda.get_current_stream().ptr)
        built.graph.execute({built.tensors[name]: a.data.ptr for name, a in arrays.items()}, workspace,
                            handle=self.handle)

    def forward(self, q: Array, k: Array, v: Array, alloc: Alloc | None = None) -> tuple[Array, AttentionContext]:
        B, T, H, Hkv, Dh = _check(q, k, v)
        cupy = self.cupy
        o = cupy.empty_like(q)
        stats = (alloc or (lambda shape, dtype: cupy.empty(shape, dtype=dtype)))((B, H, T, 1), np.float32)
        if B * T * H:
            self._execute(self._graph("forward", B, T, H, Hkv, Dh), {"q": q, "k": k, "v": v, "o": o, "stats": stats})
        return o, CudnnContext(q, k, v, o, stats)

    def backward(self, do: Array, ctx: AttentionContext) -> tuple[Array, Array, Array]:
        q, k, v, o, stats = cast(CudnnContext, ctx)  # this backend's own context
        B, T, H, Hkv, Dh = _check(q, k, v)
        if do.shape != q.shape or do.dtype != q.dtype or not do.flags.c_contiguous:
            raise ValueError(f"dO must be C-contiguous {q.dtype} of shape {q.shape}, got {do.dtype} {do.shape}")
        cupy = self.cupy
        dq, dk, dv = cupy.empty_like(q), cupy.empty_like(k), cupy.empty_like(v)
        if B * T * H:
            self._execute(self._graph("backward", B, T, H, Hkv, Dh),
                          {"q": q, "k": k, "v": v, "o": o, "do": do, "stats": stats, "dq": dq, "dk": dk, "dv": dv})
        return dq, dk, dv


def _check(q: Array, k: Array, v: Array) -> tuple[int, int, int, int, int]:
    """(B, T, H, Hkv, Dh) of C-contiguous bfloat16 q [B,T,H,Dh], k, v [B,T,Hkv,Dh]; ValueError else."""
    B, T, H, Dh = q.shape
    for name, a in (("q", q), ("k", k), ("v", v)):
        if a.dtype.name != "bfloat16" or not a.flags.c_contiguous or a.ndim != 4:
            raise ValueError(f"cuDNN attention takes C-contiguous 4-D bfloat16 arrays; {name} is {a.dtype} {a.shape}")
    Hkv = k.shape[2]
    if k.shape != (B, T, Hkv, Dh) or v.shape != k.shape or Hkv == 0 or H % Hkv:
        raise ValueError(f"k {k.shape} and v {v.shape} do not form key/value heads for q {q.shape}")
    return B, T, H, Hkv, Dh
