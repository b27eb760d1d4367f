"""Which attention kernels a GPU runs: the tensor-core (WMMA) kernels or the float32 FMA ones.

bfloat16 on an NVIDIA GPU of compute capability 8.0 or later (32 lanes: A100, H100) runs the WMMA
kernels of kernels/attention.cu; float32, AMD GPUs (no MFMA kernels yet) and older NVIDIA parts run
the FMA kernels. BOOSTMPI_ATTENTION_TENSOR_CORES: unset or "auto" is that rule, falling back to the
FMA kernels with one line on standard error when CUDA's crt/mma.h cannot be found; "1" is the same
rule, but a missing header is a problem start-up reports; "0" is the FMA kernels everywhere.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
import shutil
import sys
from pathlib import Path
from typing import Protocol

ENV = "BOOSTMPI_ATTENTION_TENSOR_CORES"
# Where each CUDA major's pip wheels put crt/mma.h (the header the runtime's mma.h includes), and the
# package that brings it: CUDA 12's headers are split over one folder per wheel, crt/ in the nvcc
# wheel's nvidia/cuda_nvcc/include; CUDA 13's wheels share nvidia/cu13/include, crt/ from nvidia-cuda-crt
# (a folder CuPy 14.2 already hands NVRTC: cupy/_environment.py derives the CUDA root from NVRTC's
# library, nvidia/cu13/lib, and cupy._core.core adds its include/).
WHEEL_HEADERS = {12: ("nvidia.cuda_nvcc", "boostmpi[gpu]'s nvidia-cuda-nvcc-cu12"),
                 13: ("nvidia.cu13", "boostmpi[gpu-cuda13]'s nvidia-cuda-crt")}
CUPY_WHEELS = {"cupy-cuda12x": 12, "cupy-cuda13x": 13}


class _DeviceTraits(Protocol):
    """What `use_wmma` reads of a device (boostmpi.gpu.kernels' _Device, a NamedTuple: read-only)."""

    @property
    def warp_size(self) -> int: ...

    @property
    def nvidia_major(self) -> int: ...


def cupy_cuda_major() -> int | None:
    """The CUDA major of the installed CuPy wheel (cupy-cuda12x: 12, cupy-cuda13x: 13), None for
    neither (CuPy built from source, a ROCm wheel, no CuPy)."""
    for dist, major in CUPY_WHEELS.items():
        try:
            importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        return major
    return None


def header_missing(major: int | None = None) -> str:
    """The one line saying crt/mma.h is missing, naming the package that brings it for CUDA `major`
    (default: the installed CuPy's)."""
    major = major or cupy_cuda_major()
    majors = [major] if major in WHEEL_HEADERS else sorted(WHEEL_HEADERS)
    packages = " or ".join(f"{WHEEL_HEADERS[m][1]} (CUDA {m})" for m in majors)
    return f"CUDA's crt/mma.h was not found (it comes with {packages}, or load a CUDA module or set CUDA_PATH to a CUDA toolkit)"


def _cupy_include_dirs() -> list[Path]:
    """The -I folders CuPy's RawModule hands NVRTC (cupy._core.core.assemble_cupy_compiler_options: its
    own headers, then CUDA's include/ under the root cupy/_environment.py finds); [] without the real CuPy."""
    try:
        from cupy._core import core
        options = core.assemble_cupy_compiler_options(())
    except (ImportError, AttributeError, RuntimeError, OSError):  # no CuPy, the tests' stand-in, no NVRTC
        return []
    return [Path(option[2:]) for option in options if option.startswith("-I")]


def _wheel_include_dirs(major: int | None) -> list[Path]:
    """include/ of the wheel that holds crt/ for CUDA `major` (both majors' when it is not known)."""
    out = []
    for m in [major] if major in WHEEL_HEADERS else sorted(WHEEL_HEADERS):
        try:
            spec = importlib.util.find_spec(WHEEL_HEADERS[m][0])
        except ModuleNotFoundError:  # no nvidia.* wheel at all (a centre's venv: CUDA from its module)
            spec = None
        out += [Path(p) / "include" for p in (spec.submodule_search_locations or [])] if spec else []
    return out


@functools.lru_cache(maxsize=None)
def mma_include() -> str | None:
    """-I<dir> holding CUDA's crt/mma.h, for the CUDA of the installed CuPy: a folder on CuPy's own
    NVRTC include path (CUDA 13's wheels, a toolkit CuPy found), else the wheel layout of CuPy's CUDA
    major, else $CUDA_PATH, $CUDA_HOME or the toolkit of the nvcc on PATH (what a centre's CUDA module
    sets); None if none has it."""
    candidates = _cupy_include_dirs() + _wheel_include_dirs(cupy_cuda_major())
    candidates += [Path(os.environ[v]) / "include" for v in ("CUDA_PATH", "CUDA_HOME") if os.environ.get(v)]
    if nvcc := shutil.which("nvcc"):
        candidates.append(Path(nvcc).resolve().parents[1] / "include")
    for directory in candidates:
        if (directory / "crt" / "mma.h").is_file():
            return f"-I{directory}"
    return None


def setting() -> str:
    """"auto", "1" or "0" (ValueError for anything else)."""
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if value not in ("auto", "1", "0"):
        raise ValueError(f"{ENV}={value!r}: use 1 (tensor cores), 0 (FMA kernels) or auto")
    return value


def use_wmma(suffix: str, device: _DeviceTraits) -> bool:
    """Whether the attention on `suffix` ("bf16", "f32") runs the WMMA kernels on `device`
    (boostmpi.gpu.kernels' _Device: warp_size, nvidia_major)."""
    chosen = setting()
    if chosen == "0" or suffix != "bf16" or device.warp_size != 32 or device.nvidia_major < 8:
        return False
    if mma_include() is None:
        if chosen == "1":
            raise RuntimeError(f"{ENV}=1: {header_missing()}")
        _say_once(f"boostmpi: the bfloat16 attention runs on the float32 FMA kernels, not tensor cores: {header_missing()}")
        return False
    return True


def problem(suffix: str, device: _DeviceTraits) -> str | None:
    """Why `use_wmma` would fail for this run, or None."""
    try:
        use_wmma(suffix, device)
    except (ValueError, RuntimeError) as exc:
        return str(exc)
    return None


@functools.lru_cache(maxsize=None)
def _say_once(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
