"""Which attention kernels a GPU runs: the tensor-core (WMMA) kernels or the float32 FMA ones.

bfloat16 on an NVIDIA GPU of compute capability 8.0 or later (32 lanes: A100, H100) runs the WMMA
kernels of kernels/attention.cu; float32, AMD GPUs (no MFMA kernels yet) and older NVIDIA parts run
the FMA kernels. BOOSTMPI_ATTENTION_TENSOR_CORES: unset or "auto" is that rule, falling back to the
FMA kernels with one line on standard error when CUDA's crt/mma.h cannot be found; "1" is the same
rule, but a missing header is a problem start-up reports; "0" is the FMA kernels everywhere.
"""

import functools
import importlib.util
import os
import shutil
import sys
from pathlib import Path

ENV = "BOOSTMPI_ATTENTION_TENSOR_CORES"
HEADER_MISSING = ("CUDA's crt/mma.h was not found (it comes with boostmpi[gpu]'s nvidia-cuda-nvcc-cu12, or "
                  "load a CUDA module or set CUDA_PATH to a CUDA toolkit)")


@functools.lru_cache(maxsize=None)
def mma_include():
    """-I<dir> holding CUDA's crt/mma.h, which the mma.h on CuPy's NVRTC include path (the runtime
    wheel's) includes: the nvcc wheel's include/, else $CUDA_PATH, $CUDA_HOME or the toolkit of the
    nvcc on PATH (what a centre's CUDA module sets); None if none has it."""
    try:
        spec = importlib.util.find_spec("nvidia.cuda_nvcc")
    except ModuleNotFoundError:  # no nvidia.* wheel at all (a centre's venv: CUDA from its module)
        spec = None
    candidates = [Path(p) / "include" for p in (spec.submodule_search_locations or [])] if spec else []
    candidates += [Path(os.environ[v]) / "include" for v in ("CUDA_PATH", "CUDA_HOME") if os.environ.get(v)]
    if shutil.which("nvcc"):
        candidates.append(Path(shutil.which("nvcc")).resolve().parents[1] / "include")
    for directory in candidates:
        if (directory / "crt" / "mma.h").is_file():
            return f"-I{directory}"
    return None


def setting():
    """"auto", "1" or "0" (ValueError for anything else)."""
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if value not in ("auto", "1", "0"):
        raise ValueError(f"{ENV}={value!r}: use 1 (tensor cores), 0 (FMA kernels) or auto")
    return value


def use_wmma(suffix, device):
    """Whether the attention on `suffix` ("bf16", "f32") runs the WMMA kernels on `device`
    (boostmpi.gpu.kernels' _Device: warp_size, nvidia_major)."""
    chosen = setting()
    if chosen == "0" or suffix != "bf16" or device.warp_size != 32 or device.nvidia_major < 8:
        return False
    if mma_include() is None:
        if chosen == "1":
            raise RuntimeError(f"{ENV}=1: {HEADER_MISSING}")
        _say_once(f"boostmpi: the bfloat16 attention runs on the float32 FMA kernels, not tensor cores: {HEADER_MISSING}")
        return False
    return True


def problem(suffix, device):
    """Why `use_wmma` would fail for this run, or None."""
    try:
        use_wmma(suffix, device)
    except (ValueError, RuntimeError) as exc:
        return str(exc)
    return None


@functools.lru_cache(maxsize=None)
def _say_once(line):
    print(line, file=sys.stderr, flush=True)
