"""Every dtype decision of boostmpi, in one place: callers ask here, none decides for itself.

`train.dtype` names the run's precision: "float64" (gradient checks), "float32" (the CPU default)
or "bfloat16" (GPU mixed precision). From it and from the dtype of the data at hand:

| what                                  | float64 | float32 | bfloat16 | asked through          |
|---------------------------------------|---------|---------|----------|------------------------|
| master weights, gradients, AdamW state| float64 | float32 | float32  | `master_dtype`         |
| weights and activations in the passes | float64 | float32 | bfloat16 | `compute_dtype`        |
| statistics: sums of squares, scores,  | float64 | float32 | float32  | `statistic_dtype`      |
|   softmax, loss, GEMM accumulators    |         |         |          |                        |
| a sum over MPI (MPI has no bfloat16)  | float64 | float32 | float32  | `mpi_sum_dtype`        |
| a checkpoint evaluated on the CPU     | float64 | float32 | float32  | `cpu_dtype_name`       |

NCCL sums bfloat16 itself (ncclBfloat16, `nccl_dtype_name`); a type a library has no name for moves
as unsigned integers of its width (`bits_dtype`); the host collectives carry float64 (losses, norms,
counters: `HOST_DTYPE`). Under mixed precision with ZeRO-1 the master weights exist for the rank's
slice only (`separate_master`). The performance model asks by name: `itemsize` (bytes per element)
and `master_dtype_name`.
"""

from types import ModuleType

import numpy as np
from numpy.typing import DTypeLike

NAMES = ("float64", "float32", "bfloat16")
ITEMSIZE = {"float64": 8, "float32": 4, "bfloat16": 2}  # bytes per element of each `train.dtype`
HOST_DTYPE = np.float64  # the host collectives' floats (losses, norms, traffic counters, flags)
NCCL_NAMES = ("float32", "float64", "int32", "int64", "bfloat16")  # the dtypes NCCL moves and sums as themselves


def master_dtype(name: str) -> type[np.float64] | type[np.float32]:
    """Master weights, gradients and optimizer state: float64 for a float64 run, else float32."""
    return np.float64 if name == "float64" else np.float32


def itemsize(dtype: DTypeLike) -> int:
    """Bytes per element of `dtype`: a `train.dtype` name (bfloat16 without ml_dtypes) or a NumPy dtype."""
    return ITEMSIZE[dtype] if isinstance(dtype, str) else np.dtype(dtype).itemsize


def master_dtype_name(name: str) -> str:
    """`master_dtype` by name: the `train.dtype` name of the master weights of a run in `name`."""
    return np.dtype(master_dtype(name)).name


def device_problem(name: str, device: str) -> str | None:
    """One line when `train.dtype` cannot run on `train.device` ("cpu" or "gpu"), else None."""
    if name == "bfloat16" and device == "cpu":
        return 'train.dtype = "bfloat16" needs train.device = "gpu" (NumPy has no bfloat16)'
    return None


def compute_dtype(name: str, xp: ModuleType = np) -> DTypeLike:
    """Weights and activations in the forward and backward passes; bfloat16 only on a GPU (CuPy takes
    the type from ml_dtypes), after checking that the installed CuPy, NumPy and ml_dtypes support it."""
    if name == "bfloat16":
        from boostmpi.errors import UserError

        if xp is np:
            raise UserError(device_problem(name, "cpu"))
        from boostmpi.backend import check_bf16_gpu

        check_bf16_gpu()
        try:
            import ml_dtypes
        except ImportError as exc:
            raise UserError(f"bfloat16 needs the ml_dtypes package ({exc})") from exc
        return ml_dtypes.bfloat16
    return {"float64": np.float64, "float32": np.float32}[name]


def statistic_dtype(dtype: DTypeLike) -> np.dtype:
    """Statistics computed from data of `dtype` (sums of squares, attention scores and softmax, the
    loss, a GEMM's accumulator): at least float32, as the kernels accumulate; float64 stays float64."""
    return np.promote_types(dtype, np.float32)


def mpi_sum_dtype(dtype: DTypeLike, mpi_knows: bool) -> np.dtype:
    """The dtype MPI sums data of `dtype` in: itself when MPI knows it (`mpi_knows`), else (bfloat16)
    float32, each sum rounded back once at the end."""
    return np.dtype(dtype) if mpi_knows else np.dtype(np.float32)


def separate_master(compute: DTypeLike, master: DTypeLike, sharded: bool) -> bool:
    """True when the master weights are a ZeRO-1 slice of their own beside a whole compute copy: mixed
    precision (`compute` differs from `master`) with the optimizer state sharded."""
    return sharded and np.dtype(compute) != np.dtype(master)


def cpu_dtype_name(trained: str) -> str:
    """The `train.dtype` to evaluate or sample a checkpoint with on the CPU: float64 when the run trained
    in it, else float32 (NumPy has no bfloat16)."""
    return "float64" if trained == "float64" else "float32"


def nccl_dtype_name(dtype: DTypeLike) -> str | None:
    """The name of NCCL's type for data of `dtype` (`ncclFloat32` is "float32"): the dtype itself, bfloat16
    included (NCCL sums it without a wider copy, unlike MPI); None for a dtype NCCL has no type for."""
    name = np.dtype(dtype).name
    return name if name in NCCL_NAMES else None


def bits_dtype(dtype: DTypeLike) -> type[np.unsignedinteger]:
    """What data of `dtype` moves as where a library has no type for it (bfloat16 over MPI): unsigned
    integers of its width, or bytes for another width; its bits arrive unchanged."""
    widths: dict[int, type[np.unsignedinteger]] = {2: np.uint16, 4: np.uint32, 8: np.uint64}
    return widths.get(np.dtype(dtype).itemsize, np.uint8)
