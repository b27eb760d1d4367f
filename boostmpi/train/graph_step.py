"""The training step captured once in a CUDA graph and replayed every step (`train.cuda_graph = true`).

An eager step issues every kernel from Python: on one H200 the 350M model's step (bench/gpu_step.py,
bench/log/gpu_step.md) issues 1904 device activities at about 48 µs of host work each, and the device
waits for the host. Captured once, the step is one graph launch. What a capture needs of the step, and
where it gets it:

* the library's GEMMs: CuPy 14.2.0's cuBLAS binding refuses to be called while a stream captures, so
  the capture goes through `boostmpi.gpu.cublas_capture` (cuBLAS's own functions through ctypes);
* no host read inside it: the engine's `forward_backward_on_device` leaves the loss and the gradient's
  squared norm on the device, and AdamW's fused update reads its per-step numbers (the learning rate, the
  bias corrections) from a device buffer and clips by the device's norm (`AdamW.step_on_device`,
  kernels/adamw.cu `adamw_step_device_f32`);
* fixed addresses: before each launch the token ids are copied into static device buffers and the step's
  numbers into the scalar buffer, on the graph's stream; inside the step the loss and the squared norm
  are copied into a static output buffer, read once after the launch (the step's one synchronisation);
* a stream and a memory pool of its own: CuPy captures only on a stream other than the legacy default
  one (cupy/cuda/stream.pyx at CuPy v14.2.0). The chunks the captured step allocated and freed are the
  graph's working memory from then on: they stay free in the pool, where only the graph's own step
  allocates (`pools.PrivatePool`; the static buffers are made before the capture), and where no other
  pool's fallback on a failed cudaMalloc frees them. Validation and checkpoints run on the default
  stream and pool, after the host has seen the step finish, and the next launch waits for them.

The first `WARMUP_STEPS` steps run the same step eagerly on the graph's stream, so that kernels are
compiled, cuDNN's attention graphs built, lazily made device constants made and the pool holds the
step's blocks before the capture; the next step is captured and launched, and every later one is
launched. A run resumed from a checkpoint warms up and captures again after loading it. Every step's
numbers are bitwise those of the eager loop (`Engine.forward_backward` and `optimizer_step`).

Refused at start-up, in one line (`check`): a CPU run; ROCm (CuPy cannot capture on HIP); more than one
rank (each step ends in a host all-reduce of the loss, the norm, the traffic counters and the stop flags);
`train.dtype = float64` (AdamW's float64 update is array operations handed the learning rate by value);
`train.attention = torch`, or `auto` that chose torch (PyTorch's SDPA allocates from PyTorch's caching
allocator, which does not take part in a CuPy capture). What the loop still does on the host per step
(the stop flags, the write-failure flag, the traffic counters, all local to the one rank) is read before
the launch, outside the graph (boostmpi/train/trainer.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np

from boostmpi.arrays import Array
from boostmpi.errors import ConfigError
from boostmpi.gpu import cublas_capture
from boostmpi.gpu.pools import PrivatePool

if TYPE_CHECKING:
    from boostmpi.config import Config
    from boostmpi.parallel.engine import Engine
    from boostmpi.parallel.grid import ProcessGrid
    from boostmpi.train.optim import AdamW

WARMUP_STEPS = 2  # eager steps on the graph's stream before the capture


class CapturedGraph(Protocol):
    """What a capture returns (cupy.cuda.Graph)."""

    def launch(self, stream: object = None) -> None: ...


def refusal(cfg: Config, grid: ProcessGrid) -> str | None:
    """Why `train.cuda_graph = true` cannot run this configuration on this grid (None: it can). On a GPU
    it reads the attention backend start-up chose (`startup.choose_attention`)."""
    tr, what = cfg.train, "train.cuda_graph = true"
    if tr.device != "gpu":
        return f'{what} needs train.device = "gpu" (a CUDA graph replays device work)'
    if grid.world_size > 1:
        return (f"{what} runs on one rank, and this run has {grid.world_size}: each step ends in a host all-reduce "
                f"(loss, gradient norm, traffic counters, stop flags) that a CUDA graph cannot hold")
    if tr.dtype == "float64":
        return (f"{what} needs train.dtype = float32 or bfloat16: AdamW's float64 update is array operations handed "
                "the learning rate by value, which a captured step would keep from its capture")
    from boostmpi.backend import get_xp

    if get_xp("gpu").cuda.runtime.is_hip:
        return f"{what} needs CUDA: CuPy cannot capture a graph on ROCm/HIP"
    from boostmpi.gpu import attention

    if attention.current().name == "torch":
        chose = " (which chose torch on this machine)" if tr.attention == "auto" else ""
        return (f"{what} cannot capture train.attention = {tr.attention}{chose}: PyTorch's SDPA allocates from "
                "PyTorch's caching allocator, which does not take part in a CuPy capture; set train.attention = "
                "cudnn or own")
    return None


def check(cfg: Config, grid: ProcessGrid) -> None:
    """Raise the one-line ConfigError of `refusal` (every rank decides alike: each raises, rank 0 prints)."""
    problem = refusal(cfg, grid) if cfg.train.cuda_graph else None
    if problem is not None:
        error = ConfigError(problem)
        error.all_ranks = True
        raise error


class GraphStep:
    """One rank's training step in a CUDA graph. `step(micro_batches, lr)` runs forward and backward over
    the micro-batches, the gradient norm, clipping to `max_norm` (0: off) and AdamW's update, and returns
    (loss, gradient norm): the numbers `Engine.forward_backward` and `optimizer_step` return, bitwise."""

    def __init__(self, engine: Engine, optimizer: AdamW, max_norm: float, warmup: int = WARMUP_STEPS) -> None:
        if warmup < 1:
            raise ValueError("a graph step needs at least one eager step before its capture (lazily made constants)")
        xp = engine.xp
        self.engine, self.optimizer, self.max_norm, self.warmup = engine, optimizer, max_norm, warmup
        self.stream = xp.cuda.Stream(non_blocking=True)
        self.private = PrivatePool()  # everything the step allocates, the capture's working memory among it
        with self.stream, xp.cuda.using_allocator(self.private.pool.malloc):  # used on that stream only
            self.scalars = xp.zeros(3, dtype=np.float32)  # this step's AdamW numbers (AdamW.device_scalars)
            self.out = xp.zeros(2, dtype=np.float64)  # the step's loss sum and squared gradient norm
        self.inputs: list[tuple[Array, Array]] | None = None  # static token ids (x, y) per micro-batch
        self.graph: CapturedGraph | None = None
        self.eager_steps = 0

    def step(self, micro_batches: Sequence[tuple[np.ndarray, np.ndarray]], lr: float) -> tuple[float, float]:
        xp = self.engine.xp
        queued = xp.cuda.get_current_stream().record()  # what the run queued (loading, validation) comes first
        with self.stream, xp.cuda.using_allocator(self.private.pool.malloc):
            self.stream.wait_event(queued)
            self._load(micro_batches, lr)
            if self.graph is None and self.eager_steps < self.warmup:
                self.eager_steps += 1
                self._body()
            else:
                (self.graph or self._capture()).launch(self.stream)
            loss_sum, grad_sq = self.out.get().tolist()  # the step's one read
        totals = np.array([loss_sum / len(micro_batches), grad_sq], dtype=np.float64)  # as forward_backward sums them
        return float(totals[0]), float(np.sqrt(totals[1]))

    def _load(self, micro_batches: Sequence[tuple[np.ndarray, np.ndarray]], lr: float) -> None:
        """The step's token ids into the static inputs and its AdamW numbers into the scalar buffer, queued on
        the graph's stream."""
        xp = self.engine.xp
        if self.inputs is None:  # made before the capture and kept: the graph reads them where they are
            self.inputs = [(xp.empty(x.shape, x.dtype), xp.empty(y.shape, y.dtype)) for x, y in micro_batches]
        if len(micro_batches) != len(self.inputs):
            raise ValueError(f"a captured step takes {len(self.inputs)} micro-batches, got {len(micro_batches)}")
        for static, batch in zip(self.inputs, micro_batches):
            for to, a in zip(static, batch):
                if a.shape != to.shape or a.dtype != to.dtype:
                    raise ValueError(f"a captured step takes token ids of shape {to.shape} and dtype {to.dtype}, "
                                     f"got {a.shape} {a.dtype}")
                to.set(np.ascontiguousarray(a), stream=self.stream)
        self.scalars.set(self.optimizer.device_scalars(lr), stream=self.stream)

    def _body(self) -> None:
        """The step as the graph holds it: nothing in it reads the device from the host."""
        e = self.engine
        assert self.inputs is not None
        loss_sum, grad_sq = e.forward_backward_on_device(self.inputs)
        self.optimizer.step_on_device(e.data_parallel.grad_shard, self.scalars, grad_sq, self.max_norm)
        e.data_parallel.gather_update(e.params, e.master, e.master_separate)
        self.out[0] = loss_sum
        self.out[1] = grad_sq

    def _capture(self) -> CapturedGraph:
        self.stream.begin_capture()
        try:
            with cublas_capture.capturing():  # CuPy's cuBLAS binding refuses a capturing stream
                self._body()
        except BaseException as exc:
            try:
                self.stream.end_capture()  # leave the stream usable; the capture itself is lost
            except Exception:  # noqa: BLE001 - an invalidated capture may refuse to end; the first error is the one
                pass
            exc.add_note("(while capturing the training step in a CUDA graph, train.cuda_graph = true: the step did "
                         "something a capture cannot hold; train.cuda_graph = false runs it eagerly)")
            raise
        self.graph = self.stream.end_capture()
        return self.graph
