"""cuBLAS's GEMMs while a CUDA graph is captured (`train.cuda_graph`, boostmpi/train/graph_step.py).

CuPy 14.2.0's cuBLAS binding refuses every call while CuPy's current stream captures: its `setStream`,
which each of its functions calls first, raises NotImplementedError("calling cuBLAS API during stream
capture is currently unsupported") (cupy_backends/cuda/libs/cublas.pyx at v14.2.0, lines 642-651; its
comment: most cuBLAS routines do capture, but CuPy has not yet tested the conditions). cuBLAS itself
captures GEMMs with host alpha and beta (cuBLAS documentation, "CUDA Graphs Support",
https://docs.nvidia.com/cuda/cublas/#cuda-graphs-support). So while a graph step is captured
(`capturing()`), `boostmpi.gpu.blas` calls the same two functions of the library CuPy loaded through
ctypes instead (`binding`): `cublasSetStream_v2` with CuPy's current stream, then `cublasGemmEx` or
`cublasGemmStridedBatchedEx` with the arguments CuPy's binding is handed, on CuPy's handle. Outside a
capture nothing changes.

The library is the libcublas CuPy's binding loaded (read from /proc/self/maps), else the loader's.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import os
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import NamedTuple

from boostmpi.gpu import hipblas

# cublas_api.h (CUDA 12 and 13): hipBLAS's GEMMs mirror cuBLAS's argument for argument (enums C ints, handles
# and streams pointers, strides 64-bit), so the prototypes are hipblas.py's
PROTOTYPES = {"cublasSetStream_v2": (ctypes.c_void_p, ctypes.c_void_p), "cublasGemmEx": hipblas.PROTOTYPES["gemm"],
              "cublasGemmStridedBatchedEx": hipblas.PROTOTYPES["strided"]}


class Library(NamedTuple):
    """The three functions, declared (each returns a cublasStatus_t; 0 is success)."""
    set_stream: Callable[..., int]
    gemm: Callable[..., int]
    gemm_strided: Callable[..., int]


_active = False
_refuses: bool | None = None  # whether CuPy's binding refuses a capturing stream (asked once, in a capture)


@contextlib.contextmanager
def capturing() -> Iterator[None]:
    """While a graph step is captured: `binding` is this module."""
    global _active
    _active, before = True, _active
    try:
        yield
    finally:
        _active = before


def binding(cublas: ModuleType) -> ModuleType:
    """CuPy's cuBLAS binding `cublas`, or during `capturing()`, where that binding refuses a capturing
    stream, this module, whose two GEMMs take its arguments. Whether it refuses is asked once, of its
    `setStream` with the capturing stream (CuPy 14.2.0 raises there before calling cuBLAS)."""
    global _refuses
    import sys

    if not _active:
        return cublas
    if _refuses is None:
        import cupy

        try:
            cublas.setStream(cupy.cuda.get_cublas_handle(), cupy.cuda.get_current_stream().ptr)
            _refuses = False
        except NotImplementedError:
            _refuses = True
    return sys.modules[__name__] if _refuses else cublas


def loaded_path() -> str | None:
    """The libcublas this process has loaded (CuPy's binding links it), else the loader's, else None."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split(maxsplit=5)[-1].strip()
                if os.path.basename(path).startswith("libcublas.so"):
                    return path
    except OSError:
        pass
    return ctypes.util.find_library("cublas")


@functools.lru_cache(maxsize=None)
def library() -> Library:
    path = loaded_path()
    if path is None:
        raise RuntimeError("train.cuda_graph: no libcublas is loaded or found, so the step's GEMMs cannot be captured")
    lib = ctypes.CDLL(path)
    functions = []
    for name, argtypes in PROTOTYPES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, ctypes.c_int
        functions.append(fn)
    return Library(*functions)


def _call(name: str, handle: int, *args: object) -> None:
    import cupy

    lib = library()
    status = lib.set_stream(handle, cupy.cuda.get_current_stream().ptr)
    if status == 0:
        status = (lib.gemm if name == "cublasGemmEx" else lib.gemm_strided)(handle, *args)
    if status != 0:
        raise RuntimeError(f"{name} returned cuBLAS status {status} while capturing the training step")


def gemmEx(handle: int, *args: object) -> None:
    """CuPy's `cublas.gemmEx(handle, transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C,
    Ctype, ldc, computeType, algo)`, on CuPy's current stream, through the library."""
    _call("cublasGemmEx", handle, *args)


def gemmStridedBatchedEx(handle: int, *args: object) -> None:
    """CuPy's `cublas.gemmStridedBatchedEx(...)` (its arguments), on CuPy's current stream, through the library."""
    _call("cublasGemmStridedBatchedEx", handle, *args)
