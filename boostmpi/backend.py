"""The one place that chooses between NumPy (CPU) and CuPy (GPU), and the dtype policy.

Everywhere else: `xp = get_array_module(x)`.
"""

import sys
from types import ModuleType

import numpy as np

from boostmpi.arrays import Array
from boostmpi.errors import UserError

# CuPy is imported when a GPU is first asked for (`get_xp("gpu")`, `gpu_unavailable_reason`), not with this
# module: a CPU run never pays for it (0.15-0.3 s a process, in every rank). Guarded: CuPy is an optional
# extra and may be installed without a usable device.
_cupy: ModuleType | None = None
_cupy_import_error: Exception | None = None


def _cupy_module() -> ModuleType | None:
    """CuPy, imported on the first call; None where it does not import (the error is kept)."""
    global _cupy, _cupy_import_error
    if _cupy is None and _cupy_import_error is None:
        try:
            import cupy

            _cupy = cupy
        except Exception as exc:  # noqa: BLE001 - any import failure means "no CuPy"
            _cupy_import_error = exc
    return _cupy


def _imported_cupy() -> ModuleType | None:
    """CuPy if something imported it, else None: a CuPy array exists only once CuPy is imported, so a
    question about an array never imports it."""
    cupy = sys.modules.get("cupy")
    return cupy if cupy is not None and hasattr(cupy, "ndarray") else None


def gpu_unavailable_reason() -> str | None:
    cupy = _cupy_module()
    if cupy is None:
        return f"CuPy is not importable ({type(_cupy_import_error).__name__}: {_cupy_import_error})"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001
        return f"CuPy cannot reach a GPU ({type(exc).__name__}: {exc})"
    return None if n > 0 else "CuPy found no GPU"


def get_xp(device: str) -> ModuleType:
    """The array module for `device` ("cpu" or "gpu"); a clear error if no GPU is usable."""
    if device == "cpu":
        return np
    if device == "gpu":
        reason = cupy_wheels_problem() or gpu_unavailable_reason()
        if reason is not None:
            raise UserError(f"train.device = \"gpu\" but {reason}; install boostmpi[gpu] on a GPU node or use device = \"cpu\"")
        assert _cupy is not None  # gpu_unavailable_reason imported it, or gave a reason
        return _cupy
    raise UserError(f"unknown device {device!r} (expected cpu or gpu)")


# CuPy's wheels all install the one `cupy` package: with two, the files of whichever came last overwrite
# the other's, and the CUDA libraries each loads no longer match (pyproject.toml: [gpu] is CUDA 12,
# [gpu-cuda13] CUDA 13, never both)
CUPY_WHEELS = ("cupy-cuda12x", "cupy-cuda13x", "cupy-rocm-7-0")


def cupy_wheels_problem() -> str | None:
    """One line when more than one CuPy wheel is installed here, else None."""
    import importlib.metadata

    found = []
    for dist in CUPY_WHEELS:
        try:
            importlib.metadata.version(dist)
            found.append(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    if len(found) < 2:
        return None
    return (f"{' and '.join(found)} are installed in one environment (they overwrite each other's files): keep "
            "the one of this node's CUDA (pip uninstall the others, then reinstall it): boostmpi[gpu] is CUDA 12, "
            "boostmpi[gpu-cuda13] CUDA 13")


def get_array_module(x: Array) -> ModuleType:
    cupy = _imported_cupy()
    if cupy is not None:
        return cupy.get_array_module(x)
    return np


def to_numpy(x: Array) -> np.ndarray:
    """A NumPy array from a NumPy or CuPy array (a copy only when it lives on a GPU)."""
    cupy = _imported_cupy()
    if cupy is not None and isinstance(x, cupy.ndarray):
        return cupy.asnumpy(x)
    return np.asarray(x)


# What a bfloat16 run on the GPU needs. CuPy has bfloat16 from 14.0; the engine's routing is checked
# against 14.2's source (tests/cupy_calls_checked.txt), which pyproject.toml's [gpu] extra pins.
# CuPy turns bfloat16 off entirely under NumPy < 2.1.2 (its _util.pyx and _core/_scalar.pyx), and
# takes the type itself from ml_dtypes.
BF16_NEEDS = {"CuPy": (14, 2), "NumPy": (2, 1, 2), "ml_dtypes": (0, 5)}
BF16_INSTALL = ("pip install 'cupy-cuda12x[ctk]>=14.2,<14.3' 'numpy>=2.1.2' 'ml_dtypes>=0.5' "
                "(CUDA 13: 'cupy-cuda13x[ctk]>=14.2,<14.3'; or: pip install 'boostmpi[gpu]', CUDA 13 'boostmpi[gpu-cuda13]')")


def version_tuple(text: object) -> tuple[int, ...]:
    """The leading release numbers of a version string: "14.2.0+standin" -> (14, 2, 0)."""
    out = []
    for part in str(text).split("."):
        digits = ""
        for ch in part:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        out.append(int(digits))
        if len(digits) != len(part):
            break
    return tuple(out)


def bf16_gpu_problem(cupy_version: str, numpy_version: str, ml_dtypes_version: str | None) -> str | None:
    """One line saying what a bfloat16 GPU run lacks (None when nothing): versions as strings,
    ml_dtypes_version None when it is not installed."""
    found = {"CuPy": cupy_version, "NumPy": numpy_version, "ml_dtypes": ml_dtypes_version}
    short = [f"{name} >= {'.'.join(map(str, need))} (found {found[name] or 'none'})"
             for name, need in BF16_NEEDS.items() if found[name] is None or version_tuple(found[name]) < need]
    if short:
        return f"train.dtype = \"bfloat16\" on the GPU needs {', '.join(short)}: {BF16_INSTALL}"
    # ROCm needs nothing more: CuPy 14.2's hipBLAS layer has no bfloat16 matrix type
    # (cupy_backends/hip/cupy_hipblas.h: convert_hipblasDatatype_t maps cudaDataType 0-9 only and
    # throws on CUDA_R_16BF, ending the process), but the engine never hands it one: every product
    # goes through boostmpi.gpu.blas, which calls hipBLAS's own bfloat16 GEMMs there (boostmpi.gpu.hipblas),
    # or multiplies float32 copies when libhipblas is not found (docs/GPU.md)
    return None


def check_bf16_gpu() -> None:
    """Before a bfloat16 GPU run: the CuPy, NumPy and ml_dtypes it needs, or one line naming them."""
    import cupy

    try:
        import ml_dtypes

        ml_version = getattr(ml_dtypes, "__version__", "0")
    except ImportError:
        ml_version = None
    problem = bf16_gpu_problem(cupy.__version__, np.__version__, ml_version)
    if problem:
        raise UserError(problem)


def keep_host_memory() -> bool:
    """Stop glibc from handing large freed arrays back to the kernel after every use.

    The engine allocates the same large temporaries every micro-batch; by default glibc serves
    each from a fresh mmap and unmaps it on free, so every step pays page faults again (the kernel's
    share of a step's CPU time was up to 29%: bench/log/sim_validation.md, its first block). Raising the mmap threshold to its maximum and the trim
    threshold far above it keeps that memory in the heap for reuse. No effect off glibc.
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        m_trim_threshold, m_mmap_threshold = -1, -3
        ok = libc.mallopt(m_mmap_threshold, 32 * 1024 * 1024)  # glibc's ceiling on 64-bit
        ok &= libc.mallopt(m_trim_threshold, 1 << 30)
        return bool(ok)
    except (OSError, AttributeError):
        return False


def prefaulted(array: Array) -> Array:
    """`array`, zero-filled now so that every page of it is backed by memory: the first step does not
    pay the page faults of buffers that live for the whole run (an allocation's pages are mapped
    only when first written)."""
    array.fill(0)
    return array
