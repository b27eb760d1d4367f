"""The engine's own GPU step, op by op, priced with a machine profile, beside the analytical model.

One training step (forward_backward + AdamW) of the GPU path runs on the CuPy stand-in
(testing/cupy_standin) with a recorder around it: every GEMM (shape, dtype), every other kernel
the step launches (CuPy elementwise ufuncs, reductions, copies and gathers, the fused RawKernels
of boostmpi/gpu) with the bytes it reads and writes, every NCCL collective with its bytes. The
fused kernels are recorded but not executed (their arguments say what they move; the values do
not change what a step launches), so a model of some size runs in seconds. `boostmpi.sim.trace`
prices the trace with the profile (roofline per GEMM, bytes / bandwidth + launch per kernel) and
the same step is predicted by the analytical model (`boostmpi.sim.model.predict`).

The paper's 7B layout scaled down: d = 4096 / --scale, heads of 128, d_ff and rank in the same
ratios, vocabulary 32000 / --scale, T = 4096 / --scale, micro-batch 4, bf16, cola, btp, grouped,
recompute = lowrank, tensor parallelism --tp (the paper's 7B layout is tp = 4; at least --tp heads).
Traced at 1 and 2 layers and extrapolated by layer count to 32: per layer = trace(2) - trace(1).

With --tp N > 1 it runs under mpiexec with N ranks, one stand-in GPU per rank (local rank = world
rank, one node); the NCCL stand-in carries the collectives between the ranks, and rank 0 records
its own launches and NCCL calls (every rank of a tp group issues the same ones) and prints. Its
NCCL payload bytes are printed beside the engine's own byte counters (summed over the ranks) and
the analytical model's `comm_bytes`; the collectives are priced with the profile's link bandwidths
over a tp group of N.

    python bench/gpu_trace.py [--scale 8] [--machine h200] [--top 12]
    mpiexec -n 4 python bench/gpu_trace.py --tp 4 [--scale 8] ...

`--paper 7b|13b --meta --json PATH` runs the paper's layouts at full size in the stand-in's
shapes-only mode (testing/cupy_standin/README.md: arrays carry shape, dtype and a pool allocation
but no values; kernels, GEMMs and collectives are checked and recorded, not run): the 7B (d 4096,
32 layers, 32 heads, d_ff 11008, r 1024, tp 4) under `mpiexec -n 4`, the 13B (d 5120, 40 layers,
40 heads, d_ff 13824, r 1280, tp 4 x pp 2, 4 micro-batches) under `mpiexec -n 8`; both V 32000,
T 4096, micro-batch 4, bf16, cola, btp, grouped, recompute lowrank. Each rank builds the engine,
runs one step to warm up and records the second (its launches, GEMMs with their cuBLAS types,
bytes, collectives, host synchronisations, pool allocations); per-layer numbers are rank 0's
trace at 2 layers per stage minus 1 layer per stage, per micro-batch. Rank 0 writes one JSON object
(see `paper_report`).

    mpiexec -n 4 python bench/gpu_trace.py --paper 7b --meta --json 7b.json
    mpiexec -n 8 python bench/gpu_trace.py --paper 13b --meta --json 13b.json

`--gpu-step --meta` traces bench/gpu_step.py's model instead, whole (cola, d 1024, 24 layers, 16 heads,
r 256, V 32000, T 1024, micro-batch 8, bf16, the configuration's defaults otherwise: tp 1, btp, grouped,
recompute none), one step as gpu_step.py runs it (forward_backward, then AdamW's step; the second of two
recorded), and prints its launches by kind: the GEMMs (cuBLAS calls), the RawKernels, CuPy's elementwise
kernels and reductions, the copies, memsets and gathers, and the attention launches (the own kernels, one
forward and two backward launches a layer, as cuDNN's deterministic backward launches two). Each is one
launch as recorded; what the recorder does not see (cuBLAS's split-K reduction kernels, the copies between
host and device) is not in it.

    python bench/gpu_trace.py --gpu-step --meta [--json counts.json]

Attention has its own entry in the priced breakdown. `--attention BACKEND` sets `train.attention`
(cudnn, torch, own or auto; left out, the configuration's default). The own kernels are recorded launch by
launch (RawKernels); a library backend (cuDNN, PyTorch) launches no RawKernel, so its forward and
backward calls are recorded at the backend seam (`boostmpi.gpu.attention`: the backend the engine is
given), one op each, with FlashAttention-2's bytes. Each attention op is priced by the profile's measured
rate for its backend, direction and, for own, variant and head dim (`attention_rate`), on the causal FLOP
count of bench/attention.py and `boostmpi sim` (forward 2·B·H·T²·Dh, backward 2.5x; the own backward's
dQ and dK/dV launches share the backward's FLOPs 3 : 4, their T x T products); a profile without rate
tables prices that count at `attention_efficiency` of the peak, as the analytical model does.
"""

import common  # noqa: F401 - first: one BLAS thread before numpy loads

import argparse  # noqa: E402
import gc  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import warnings  # noqa: E402

from common import REPO  # noqa: E402

os.environ["BOOSTMPI_CUPY_STANDIN"] = "1"
if "--meta" in sys.argv[1:]:  # read when the stand-in is imported
    os.environ["BOOSTMPI_STANDIN_META"] = "1"
if "--paper" in sys.argv[1:]:  # one node of 8 GPUs (the 13B layout's 8 ranks; a DGX A100)
    os.environ.setdefault("BOOSTMPI_STANDIN_GPUS", "8")
from tests.support import gpu_setup  # noqa: E402 - the repository root is on sys.path (common.py)

gpu_setup.GPU.choose()  # the stand-in first on sys.path (BOOSTMPI_CUPY_STANDIN=1 above)

import numpy as np  # noqa: E402

from dataclasses import dataclass  # noqa: E402

from boostmpi.sim import trace as sim_trace  # noqa: E402
from boostmpi.sim.trace import TracedOp  # noqa: E402

LAYERS = 32
# modules whose frames are skipped when naming the call site: the array module, the communicators
# a collective passes through on its way to NCCL, and the kernel and cuBLAS wrappers (a fused
# kernel or a GEMM is named by the model function that launches it; the optimizer's as the optimizer)
INTERNAL = ("backend.py", "parallel/comm.py", "parallel/nccl.py", "gpu/kernels.py", "gpu/adamw_kernels.py",
            "gpu/blas.py")
GEMM_WRAPPERS = ("matmul", "batched_matmul", "grouped_matmul", "<listcomp>")  # of model/layers.py: a GEMM is named by its caller


# ---------------------------------------------------------------- the recorder
class Recorder:
    def __init__(self):
        self.ops, self.depth, self.on = [], 0, False
        self.group = None  # inside an NCCL group: its first recorded op, which the later collectives join

    def site(self):
        frame = sys._getframe(2)
        while frame is not None:
            path = frame.f_code.co_filename
            if "/boostmpi/" in path and not path.endswith(INTERNAL) and not (
                    path.endswith("model/layers.py") and frame.f_code.co_name in GEMM_WRAPPERS):
                module = path.split("/boostmpi/")[-1].removesuffix(".py").replace("/", ".")
                return f"{module}.{frame.f_code.co_name}"
            frame = frame.f_back
        return "?"

    def wrap(self, owner, attr, describe):
        """Replace owner.attr by a recording wrapper; `describe(result, *args, **kw)` -> TracedOp fields or None."""
        original = getattr(owner, attr)
        recorder = self

        def wrapper(*args, **kwargs):
            if not recorder.on or recorder.depth:
                return original(*args, **kwargs)
            recorder.depth += 1
            try:
                result = original(*args, **kwargs)
            finally:
                recorder.depth -= 1
            fields = describe(result, *args, **kwargs)
            if fields is not None:
                op_class = fields.pop("op_class", TracedOp)
                recorder.ops.append(op_class(site=recorder.site(), **fields))
                if recorder.group is not None and recorder.group.kind == "group":
                    recorder.group = recorder.ops[-1]
            return result

        setattr(owner, attr, wrapper)


def _nbytes(x):
    import cupy

    return x.nbytes if isinstance(x, cupy.ndarray) else 0


def install(rec, run_kernels=False):
    """Wrap the stand-in for `rec`. The fused RawKernels are recorded and, unless `run_kernels`,
    not executed (in meta mode they never run)."""
    import cupy
    from cupy import _kernel
    from cupy.cuda import cublas, nccl

    def ufunc_call(result, self, *args, out=None, **kw):
        written = _nbytes(out if out is not None else result)
        read = sum(_nbytes(a) for a in args[:self.nin])
        return dict(kind="elementwise", name=self.__name__, nbytes=read + written, dtype=str(result.dtype))

    def reduction(result, kind, a, *args, **kw):
        return dict(kind="reduction", name=kind, nbytes=a.nbytes + _nbytes(result), dtype=str(a.dtype))

    def gemm(result, api, batch, m, n, k, a_type, b_type, c_type, compute, beta_zero=True):
        """Every GEMM the cuBLAS model sees (the binding's calls and CuPy's own matmul), priced at its
        operands' dtypes: A and B read, C written, and read as well when beta != 0 (accumulated into)."""
        size = {t: cublas._storage_dtype(t).itemsize for t in (a_type, b_type, c_type)}
        c_passes = 1 if beta_zero else 2
        nbytes = batch * (m * k * size[a_type] + k * n * size[b_type] + c_passes * m * n * size[c_type])
        # cuBLAS is column-major: its m x n output is the row-major n x m product
        return dict(kind="gemm", name=api, nbytes=nbytes, dtype=cublas._storage_dtype(a_type).name,
                    gemm=(batch, n, m, k), cublas=(a_type, b_type, c_type, compute))

    def copy(name):
        def describe(result, *args, **kw):
            if not isinstance(result, cupy.ndarray) or (args and result is args[0]):
                return None  # nothing was copied (already contiguous, same dtype)
            read = sum(_nbytes(a) for a in args if isinstance(a, cupy.ndarray))
            read += sum(_nbytes(a) for a in (args[0] if args and isinstance(args[0], (list, tuple)) else ()))
            return dict(kind="copy", name=name, nbytes=read + result.nbytes, dtype=str(result.dtype))
        return describe

    def getitem(result, self, key):
        if result.base is not None:
            return None  # a view: no kernel
        return dict(kind="copy", name="gather", nbytes=2 * result.nbytes, dtype=str(result.dtype))

    def setitem(result, self, key, value):
        n = self[key].nbytes
        return dict(kind="copy", name="setitem", nbytes=n + (_nbytes(value) if _nbytes(value) else 0),
                    dtype=str(self.dtype))

    def fill(result, self, value):
        return dict(kind="copy", name="fill", nbytes=self.nbytes, dtype=str(self.dtype))

    def memset(result, *args, **kw):
        return dict(kind="copy", name="zeros", nbytes=result.nbytes, dtype=str(result.dtype))

    def kernel(result, self, grid, block, args, **kw):
        if (self.name or "").startswith("attention_"):
            return attention_kernel(self.name, args)
        moved = sum(_nbytes(a) for a in args)
        return dict(kind="kernel", name=self.name or "raw", nbytes=moved, dtype="")

    def collective(name):
        def describe(result, self, *args, **kw):
            count, datatype = (args[1], args[2]) if name in ("send", "recv") else (args[2], args[3])
            nbytes = count * nccl._dtype(datatype).itemsize
            if rec.group is not None and rec.group.kind == "collective":
                rec.group.nbytes += nbytes  # NCCL runs a group's collectives as one launch: one call
                return None
            return dict(kind="collective", name=name, nbytes=nbytes, dtype="")
        return describe

    group_start, group_end = nccl.groupStart, nccl.groupEnd

    def start():
        rec.group = TracedOp(site="?", kind="group", name="group", nbytes=0)  # the group's first collective replaces it
        group_start()

    def end():
        group_end()
        rec.group = None

    nccl.groupStart, nccl.groupEnd = start, end

    rec.wrap(cupy.ufunc, "__call__", ufunc_call)
    rec.wrap(cupy, "_reduce", reduction)
    rec.wrap(cublas, "called", gemm)
    for name in ("copy", "astype"):
        rec.wrap(cupy.ndarray, name, copy(name))
    for name in ("ascontiguousarray", "concatenate", "stack", "where", "array"):
        rec.wrap(cupy, name, copy(name))
    rec.wrap(cupy.ndarray, "__getitem__", getitem)
    rec.wrap(cupy.ndarray, "__setitem__", setitem)
    rec.wrap(cupy.ndarray, "fill", fill)
    for name in ("zeros", "zeros_like"):
        rec.wrap(cupy, name, memset)
    # the fused kernels: recorded with what their arguments move
    if not run_kernels:
        _kernel.RawKernel.__call__ = lambda self, grid, block, args, **kw: None
    rec.wrap(_kernel.RawKernel, "__call__", kernel)
    for name in ("allReduce", "allGather", "broadcast", "send", "recv"):
        rec.wrap(nccl.NcclCommunicator, name, collective(name))
    install_attention_backends(rec)


# T x T x Dh products each attention kernel computes: the forward QK^T and PV; the dQ pass QK^T,
# dO V^T and dS K; the dK/dV pass QK^T, dO V^T, P^T dO and dS^T Q
ATTENTION_PRODUCTS = {"attention_forward": 2, "attention_backward_dq": 3, "attention_backward": 4}
ATTENTION_TRAFFIC = {"attention_forward": "forward", "attention_backward_dq": "backward_dq",
                     "attention_backward": "backward_dkdv"}


def attention_kernel(name, args):
    """A fused attention launch: the bytes of its tile plan, and its share of its call's causal FLOPs (the
    forward all of the forward's; the backward's dQ and dK/dV passes 3 : 4, their T x T products), with
    what its rate is looked up by: backend own, variant (tensor-core WMMA or FMA, by the entry point),
    head dim and direction."""
    from boostmpi.gpu import kernels

    tensor_cores = "_tc_" in name
    entry = name.rsplit("_", 1)[0].replace("_hd64", "").replace("_tc", "")
    q, k = args[0], args[1]
    B, T, H, Dh = q.shape
    read, written = kernels.attention_traffic(B, T, H, k.shape[2], Dh, q.itemsize,
                                              tensor_cores=tensor_cores)[ATTENTION_TRAFFIC[entry]]
    forward = entry == "attention_forward"
    backward_products = ATTENTION_PRODUCTS["attention_backward_dq"] + ATTENTION_PRODUCTS["attention_backward"]
    share = 1.0 if forward else ATTENTION_PRODUCTS[entry] / backward_products
    return dict(kind="attention", name=name, nbytes=read + written, dtype="bfloat16" if tensor_cores else "float32",
                flops=share * causal_flops(B, T, H, Dh)[not forward], op_class=AttentionOp, backend="own",
                variant="wmma" if tensor_cores else "fma", head_dim=Dh, direction="forward" if forward else "backward")


# What an attention op's rate is looked up by. boostmpi.sim.trace.TracedOp carries these fields where the
# performance model prices attention per backend; where it does not, an op of this class carries them.
if {"backend", "variant", "head_dim", "direction"} <= set(TracedOp.__dataclass_fields__):
    AttentionOp = TracedOp
else:
    @dataclass
    class AttentionOp(TracedOp):
        backend: str = "own"  # "cudnn", "torch", "own"
        variant: str = None  # the own kernels': "wmma", "fma"; None for a library
        head_dim: int = 0
        direction: str = "forward"  # or "backward"


def causal_flops(B, T, H, Dh):
    """(forward, backward) FLOPs of a causal attention: `boostmpi sim`'s count (costs.flash_seconds) and
    bench/attention.py's: QK^T and PV over the lower triangle, the backward 2.5x."""
    forward = 2.0 * B * H * T * T * Dh
    return forward, 2.5 * forward


def library_attention(backend, direction):
    """describe() of a library backend's forward(q, k, v, alloc=None) -> (o, ctx) or backward(do, ctx) ->
    (dq, dk, dv): one op, FlashAttention-2's bytes (`operations.flash2_traffic`), the causal FLOPs."""
    from boostmpi.sim.operations import flash2_traffic

    def describe(result, first, *args, **kwargs):
        B, T, H, Dh = first.shape
        Hkv = (args[0] if direction == "forward" else result[1]).shape[2]
        moved = flash2_traffic(B * H, B * Hkv, T, Dh, first.itemsize)[direction]
        flops = causal_flops(B, T, H, Dh)[direction == "backward"]
        return dict(kind="attention", name=f"{backend.name}_{direction}", nbytes=sum(moved), dtype=str(first.dtype),
                    flops=flops, op_class=AttentionOp, backend=backend.name, head_dim=Dh, direction=direction)
    return describe


def install_attention_backends(rec):
    """Record the calls of every library attention backend the engine is given (`attention.use`) or already
    has (`attention.current()`): their forward and backward, one op each. The own backend is left alone:
    its RawKernel launches are recorded one by one. Without boostmpi.gpu.attention: nothing to do."""
    try:
        from boostmpi.gpu import attention
    except ImportError:
        return

    def instrument(backend):
        if backend is None or getattr(backend, "name", "own") == "own" or getattr(backend, "_traced", False):
            return
        for direction in ("forward", "backward"):
            rec.wrap(backend, direction, library_attention(backend, direction))
        backend._traced = True

    use = attention.use

    def recording_use(backend):
        instrument(backend)
        return use(backend)

    attention.use = recording_use
    instrument(attention.current())


def attention_rate(machine, backend, variant, Dh, direction):
    """FLOP/s (the causal count) the profile states for `backend` ("cudnn", "torch", "own"), `variant`
    ("wmma", "fma" for own; None for a library), head dim `Dh` and `direction` ("forward", "backward");
    None when the profile rates no attention (`machine.attention_rates` absent or empty).

    `machine.attention_rates` is looked up by `boostmpi.sim.attention_rates.attention_rate` where the
    performance model has it; else it is read here in the profile's TOML layout, {backend: {"source": ...,
    "forward": F, "backward": F} or {"source": ..., "d<Dh>": {"forward": F, "backward": F}, ...}}, own's per
    variant ({"source": ..., "wmma": {...}, "fma": {...}}): the head dim's entry, else the table's entry
    for every head dim, else the nearest head dim rated."""
    from boostmpi.errors import UserError

    tables = getattr(machine, "attention_rates", None)
    if not tables:
        return None
    try:
        from boostmpi.sim.attention_rates import attention_rate as profile_rate
    except ImportError:
        profile_rate = None
    if profile_rate is not None:
        return profile_rate(machine, backend, variant, Dh, direction)[0]
    table = tables.get(backend)
    if table is None:
        raise UserError(f"machine profile {machine.name} has no rate for attention backend {backend!r} "
                        f"(it rates: {', '.join(sorted(tables))})")
    body = table.get(variant, {}) if backend == "own" else table
    if "forward" in body or "backward" in body:
        return float(body[direction])
    dims = {int(key[1:]): entry for key, entry in body.items() if key[:1] == "d" and key[1:].isdigit()}
    if not dims:
        raise UserError(f"machine profile {machine.name} has no rate for attention backend {backend!r} {variant or ''}")
    return float(dims[min(dims, key=lambda dh: (abs(dh - Dh), dh))][direction])


def attention_seconds(op, machine, tp=1):
    """An attention op's seconds: its FLOPs (its share of its call's causal count) at the profile's rate for
    it (measured around whole calls: launches included), as `boostmpi.sim.trace` prices it where it
    prices attention per backend; without rate tables as `boostmpi.sim.trace` prices it."""
    if AttentionOp is TracedOp or not isinstance(op, AttentionOp):
        return sim_trace.op_seconds(op, machine, tp)
    rate = attention_rate(machine, op.backend, op.variant, op.head_dim, op.direction)
    return sim_trace.op_seconds(op, machine, tp) if rate is None else op.flops / rate


def price(ops, machine, tp=1):
    """`boostmpi.sim.trace.price` with attention apart: {"attention": seconds, ...}; the kernel launches and
    the non-GEMM bytes still count the attention ops."""
    attention = [op for op in ops if op.kind == "attention"]
    out = sim_trace.price([op for op in ops if op.kind != "attention"], machine, tp)
    out["attention"] = sum(attention_seconds(op, machine, tp) for op in attention)
    out["launches"] += len(attention)
    out["elementwise_bytes"] += sum(op.nbytes for op in attention)
    return out


def by_site(ops, machine, tp=1):
    """`boostmpi.sim.trace.by_site` with the attention ops priced by `attention_seconds`."""
    rows = sim_trace.by_site([op for op in ops if op.kind != "attention"], machine, tp)
    groups = {}
    for op in ops:
        if op.kind == "attention":
            g = groups.setdefault((op.site, op.kind), [0, 0, 0.0])
            g[0] += 1
            g[1] += op.nbytes
            g[2] += attention_seconds(op, machine, tp)
    rows += [(site, kind, n, b, sec) for (site, kind), (n, b, sec) in groups.items()]
    return sorted(rows, key=lambda row: -row[4])


def traced_config(make, ops, attention):
    """`make(attention)`: the configuration the analytical model predicts beside a trace, with the attention
    backend the trace ran (`attention` when given; else the one backend its attention ops name, where the
    configuration has `train.attention`)."""
    from boostmpi.errors import UserError

    backends = {op.backend for op in ops if op.kind == "attention"}
    if attention is not None or len(backends) != 1:
        return make(attention)
    try:
        return make(backends.pop())
    except UserError:  # a configuration without train.attention: its one attention
        return make(None)


def _attention_priced_by(ops, machine):
    """One line: the attention ops traced (backend, variant) and what priced them."""
    attention = [op for op in ops if op.kind == "attention"]
    if not attention:
        return "no attention op traced"
    kinds = sorted({f"{op.backend} {op.variant or ''}".strip() for op in attention})
    rated = all(attention_rate(machine, op.backend, op.variant, op.head_dim, op.direction) is not None
                for op in attention)
    how = (f"the measured rates of {machine.name}'s attention tables" if rated else
           f"{machine.name}'s attention_efficiency {getattr(machine, 'attention_efficiency', '?')} of the peak "
           "(no rate tables)")
    return ", ".join(kinds) + f"; priced by {how}"


# ---------------------------------------------------------------- the step
def _attention_setting(attention):
    """{"attention": attention} for the train section, or {} (the configuration's default)."""
    return {} if attention is None else {"attention": attention}


def config(scale, layers, tp=1, tp_mode="btp", arch="cola", head_dim=128, attention=None):
    from boostmpi.config import config_from_dict

    d = 4096 // scale
    model = dict(arch=arch, d_model=d, n_heads=max(d // head_dim, tp), d_ff=16 * -(-11008 // scale // 16),
                 rank=1024 // scale, vocab_size=32000 // scale, seq_len=4096 // scale, n_layers=layers)
    return config_from_dict({"model": model, "parallel": {"tp": tp, "tp_mode": tp_mode, "grouped": True},
                             "train": {"device": "gpu", "dtype": "bfloat16", "micro_batch_size": 4,
                                       "recompute": "lowrank" if tp_mode == "btp" else "none",
                                       **_attention_setting(attention)}})


def trace_step(rec, cfg, world=None):
    """(ops this rank launched, the engine's counters {"bytes"|"calls": per axis} summed over the ranks) of one step."""
    run = run_steps(rec, cfg, world, steps=1)
    return run["ops"], run["counted"]


def _meta_init():
    """In meta mode the engine's initial weights are not drawn: `init_local` hands back a zero-byte
    broadcast of the shard's shape, which the stand-in turns into a device array without values."""
    from boostmpi.model.params import local_box
    from boostmpi.parallel import engine

    engine.init_local = lambda spec, seed: np.broadcast_to(np.zeros((), np.float64),
                                                           tuple(hi - lo for lo, hi in local_box(spec)))


def run_steps(rec, cfg, world=None, steps=1, max_norm=1.0):
    """Build the engine, run `steps` optimizer steps (forward_backward + optimizer_step with `max_norm`)
    and record the last. Returns {"ops", "counted": the engine's tp/pp/dp counters of the recorded
    step summed over the ranks, "host_syncs": the host's blocking waits in it, "ranges": its NVTX
    events [(push|pop|mark, name)], "pool": this rank's
    pool high-water marks over the whole run {"total": bytes held, "used": bytes in use}, and
    "largest_fb": the largest allocation made during the recorded step's forward_backward}."""
    import cupy
    from cupy.cuda import _queue, nvtx

    from boostmpi.parallel.comm import AXES
    from boostmpi.parallel.engine import Engine
    from boostmpi.train.optim import AdamW
    from boostmpi.train.trainer import optimizer_step

    from boostmpi.gpu.pools import kept_pool

    pools = (cupy.get_default_memory_pool(), kept_pool())
    gc.collect()  # what an earlier run left (engines hold reference cycles) goes back to the pools first
    for pool in pools:
        pool.free_all_blocks()
    device = cupy._memory  # the stand-in's marks over every pool at each moment (the device's view)
    device.standin_reset_device_peaks()
    eng = Engine(cfg, world, local_rank=0 if world is None else world.Get_rank())
    if world is not None and world.Get_size() > 1 and not eng.grid.use_nccl:
        raise RuntimeError("a multi-rank GPU run did not choose NCCL")
    opt = AdamW(eng.params, eng.specs, cfg.train, eng.xp)
    rng = np.random.default_rng(0)
    shape = (cfg.train.micro_batch_size, cfg.model.seq_len)
    batch = [(rng.integers(0, cfg.model.vocab_size, shape), rng.integers(0, cfg.model.vocab_size, shape))
             for _ in range(cfg.train.grad_accum)]
    peak = {"total": 0, "used": 0}
    largest = 0
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        for step in range(steps):
            last = step == steps - 1
            if last:
                eng.grid.counter.reset()
                for key, value in device.standin_device_peaks().items():
                    if key in peak:
                        peak[key] = max(peak[key], value)
                device.standin_reset_device_peaks()
                syncs = _queue.host_syncs
                rec.ops, rec.on = [], True
                nvtx.events = []
            try:
                eng.forward_backward(batch)
                if last:
                    largest = device.standin_device_peaks()["largest"]
                optimizer_step(eng, opt, 1e-4, max_norm)
            finally:
                rec.on = False
    syncs = _queue.host_syncs - syncs
    ranges, nvtx.events = nvtx.events, None
    for key, value in device.standin_device_peaks().items():
        if key in peak:
            peak[key] = max(peak[key], value)
    counter = eng.grid.counter
    counted = np.array([counter.bytes[a] for a in AXES] + [counter.calls[a] for a in AXES], dtype=np.int64)
    if world is not None:
        from mpi4py import MPI

        world.Allreduce(MPI.IN_PLACE, counted, op=MPI.SUM)
        for group in (eng.grid.tp, eng.grid.pp, eng.grid.dp):
            if group.comm is not None:
                group.comm.Free()
    counted = counted.tolist()
    del eng, opt
    counted = {"bytes": dict(zip(AXES, counted[:3])), "calls": dict(zip(AXES, counted[3:]))}
    return {"ops": list(rec.ops), "counted": counted,
            "host_syncs": syncs, "pool": peak, "largest_fb": largest, "ranges": ranges}


# ---------------------------------------------------------------- the paper's layouts at full size
PAPER = {
    "7b": dict(model=dict(d_model=4096, n_layers=32, n_heads=32, d_ff=11008, rank=1024),
               parallel=dict(tp=4, pp=1), grad_accum=1),
    "13b": dict(model=dict(d_model=5120, n_layers=40, n_heads=40, d_ff=13824, rank=1280),
                parallel=dict(tp=4, pp=2), grad_accum=4),
}
# device memory outside CuPy's pool, per rank: a stated allowance, not a measurement (GB = 1e9 B); on a GPU,
# bench/gpu_step.py's "device memory" lines measure it ("the rest")
ALLOWANCE = {"cuda_context": 500_000_000,  # the CUDA context and the loaded kernel modules
             "nccl": 500_000_000,  # NCCL's communicator buffers (NCCL_BUFFSIZE, 4 MiB, per channel and peer)
             "cublas_workspace": 4 * 1024 * 1024}  # cuBLAS's default workspace on pre-Hopper GPUs


def paper_config(name, n_layers=None, recompute="lowrank", attention=None):
    from boostmpi.config import config_from_dict

    p = PAPER[name]
    model = dict(arch="cola", vocab_size=32000, seq_len=4096, **p["model"])
    if n_layers is not None:
        model["n_layers"] = n_layers
    return config_from_dict({"model": model,
                             "parallel": {"tp_mode": "btp", "grouped": True, **p["parallel"]},
                             "train": {"device": "gpu", "dtype": "bfloat16", "micro_batch_size": 4,
                                       "grad_accum": p["grad_accum"], "recompute": recompute,
                                       **_attention_setting(attention)}})


def not_tensor_core(ops):
    """The recorded GEMMs that do not run bf16 x bf16 with float32 accumulation on tensor cores,
    judged from their cuBLAS types by the guide's table (the stand-in's cublas.tensor_core_bf16)."""
    from cupy.cuda import cublas

    return [op for op in ops if op.kind == "gemm" and not cublas.tensor_core_bf16(*op.cublas)]


def _site_differences(one, two, M, top):
    """[site, kind, launches, bytes, priced ms] per layer and micro-batch: trace(2) - trace(1) by call site."""
    first = {(site, kind): (n, nb, sec) for site, kind, n, nb, sec in one}
    rows = []
    for site, kind, n, nb, sec in two:
        n1, nb1, s1 = first.get((site, kind), (0, 0, 0.0))
        if n - n1 > 0:
            rows.append([site, kind, round((n - n1) / M, 2), int((nb - nb1) / M), round((sec - s1) / M * 1e3, 3)])
    return sorted(rows, key=lambda r: -r[4])[:top]


def paper_report(args, world):
    """Full-size meta traces of a paper layout on every rank; rank 0 writes the JSON object."""
    import json

    from boostmpi.sim.machines import load_machine
    from boostmpi.sim.model import predict
    from boostmpi.sim.operations import shape_of
    from boostmpi.sim.plans import plan_strategy
    from boostmpi.sim.trace import plan_launches_and_bytes

    machine = load_machine(args.machine)
    cfg = paper_config(args.paper, recompute=args.recompute, attention=args.attention)
    tp, pp, M = cfg.parallel.tp, cfg.parallel.pp, cfg.train.grad_accum
    size = 1 if world is None else world.Get_size()
    if size != tp * pp:
        raise SystemExit(f"error: --paper {args.paper} needs {tp * pp} ranks (mpiexec -n {tp * pp}), "
                         f"this job has {size}")
    rank = 0 if world is None else world.Get_rank()
    _meta_init()
    rec = Recorder()
    install(rec, run_kernels=True)
    full = run_steps(rec, cfg, world, steps=2)
    per_stage = {n: run_steps(rec, paper_config(args.paper, n * pp, args.recompute, args.attention), world, steps=1)["ops"]
                 for n in (1, 2)}
    priced = price(full["ops"], machine, tp)
    bad = not_tensor_core(full["ops"])
    mine = {"rank": rank, "priced": priced, "host_syncs": full["host_syncs"], "pool": full["pool"],
            "largest_fb": full["largest_fb"], "not_tc": len(bad), "gemms": sum(op.kind == "gemm" for op in full["ops"]),
            "not_tc_sites": sorted({f"{op.site} {op.name} A{op.cublas[0]} C{op.cublas[2]} compute{op.cublas[3]}"
                                    for op in bad})}
    ranks = [mine] if world is None else world.gather(mine, root=0)
    if rank != 0:
        return
    one, two = (price(per_stage[n], machine, tp) for n in (1, 2))
    per_layer = {k: (two[k] - one[k]) / M for k in one}
    compute = max(r["priced"]["gemm"] + r["priced"]["elementwise"] + r["priced"]["attention"] + r["priced"]["tp_comm"]
                  for r in ranks)
    p2p = max(r["priced"]["pp_p2p"] for r in ranks)
    optimizer = max(r["priced"]["optimizer"] for r in ranks)
    # 1F1B: M slots of every stage's busiest rank plus (pp - 1) slots of warm-up and cool-down
    priced_step = compute * (M + pp - 1) / M + p2p * (M + pp - 1) / M + optimizer
    prediction = predict(traced_config(lambda attention: paper_config(args.paper, recompute=args.recompute,
                                                                      attention=attention), full["ops"], args.attention),
                         machine)
    s = shape_of(cfg, "flash")  # the engine's attention: fused kernels (boostmpi/gpu/kernels.py)
    plan_launches, plan_gemms, plan_bytes = plan_launches_and_bytes(s, plan_strategy(cfg), cfg.train.recompute, 2)
    allowance = sum(ALLOWANCE.values())
    top = max(ranks, key=lambda r: r["pool"]["total"])
    m = cfg.model
    out = {
        "layout": args.paper, "recompute": args.recompute, "machine": machine.name, "ranks": size, "tp": tp, "pp": pp, "micro_batches": M,
        "launches_per_layer": round(per_layer["launches"], 2),
        "gemm_launches_per_layer": round(per_layer["gemm_launches"], 2),
        "plan_launches_per_layer": plan_launches, "plan_gemms_per_layer": plan_gemms,
        "gemm_not_tensor_core": max(r["not_tc"] for r in ranks),
        "gemm_not_tensor_core_sites": sorted({x for r in ranks for x in r["not_tc_sites"]}),
        "gemms_per_step": max(r["gemms"] for r in ranks),
        "non_gemm_bytes_per_layer": int(per_layer["elementwise_bytes"]),
        "plan_non_gemm_bytes_per_layer": int(plan_bytes),
        "priced_step_s": round(priced_step, 4),
        "priced_breakdown_s": {k: round(max(r["priced"][k] for r in ranks), 4)
                               for k in ("gemm", "elementwise", "attention", "tp_comm", "pp_p2p", "optimizer")},
        "attention_backend": _attention_priced_by(full["ops"], machine),
        "analytical_step_s": round(prediction.time_s, 4),
        "analytical_breakdown_s": {k: round(v, 4) for k, v in prediction.breakdown.items()},
        "host_syncs_per_step": max(r["host_syncs"] for r in ranks),
        "peak_device_bytes": top["pool"]["total"] + allowance,
        "peak_device_rank": top["rank"],
        "pool_peak_bytes_by_rank": [r["pool"]["total"] for r in ranks],
        "pool_peak_in_use_bytes_by_rank": [r["pool"]["used"] for r in ranks],
        "outside_pool_allowance_bytes": ALLOWANCE,
        "sim_device_bytes": prediction.memory_bytes["total"],
        "sim_memory_bytes": prediction.memory_bytes,
        "largest_step_allocation_bytes": max(r["largest_fb"] for r in ranks),
        "scores_bytes": cfg.train.micro_batch_size * (m.n_heads // tp) * m.seq_len ** 2 * 2,
        "top_sites_per_layer": _site_differences(by_site(per_stage[1], machine, tp), by_site(per_stage[2], machine, tp),
                                                 M, args.top),
    }
    text = json.dumps(out, indent=1)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    print(text)


# bench/gpu_step.py's model (its `model` and `train` dicts) with the attention whose launches the trace records
GPU_STEP_MODEL = dict(arch="cola", vocab_size=32000, d_model=1024, n_layers=24, n_heads=16, rank=256, seq_len=1024)
GPU_STEP_BATCH = 8


def gpu_step_counts(ops):
    """{kind: launches} of a trace, by the kinds a profile tells apart, and the total."""
    kinds = {"gemm": "cuBLAS GEMMs", "kernel": "RawKernels", "attention": "attention kernels",
             "elementwise": "CuPy elementwise", "reduction": "CuPy reductions", "copy": "copies, memsets, gathers"}
    counts = {name: sum(op.kind == kind for op in ops) for kind, name in kinds.items()}
    counts["total"] = sum(op.kind != "collective" for op in ops)
    return counts


def gpu_step_report(args):
    """One step of bench/gpu_step.py's model in meta mode: the launches by kind, and by kind, name and dtype."""
    import collections
    import json

    from boostmpi.config import config_from_dict
    from boostmpi.parallel.engine import Engine
    from boostmpi.train.optim import AdamW

    cfg = config_from_dict({"model": GPU_STEP_MODEL, "train": {"device": "gpu", "dtype": "bfloat16",
                                                               "micro_batch_size": GPU_STEP_BATCH, "attention": "own"}})
    _meta_init()
    rec = Recorder()
    install(rec, run_kernels=True)
    eng = Engine(cfg)
    opt = AdamW(eng.params, eng.specs, cfg.train, eng.xp)
    x = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (GPU_STEP_BATCH, cfg.model.seq_len + 1))
    batch = [(x[:, :-1], x[:, 1:])]
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        for step in range(2):  # as gpu_step.py's `ours`: forward_backward, then AdamW's step
            rec.ops, rec.on = [], step == 1
            try:
                eng.forward_backward(batch)
                opt.step(eng.grads, 1e-4)
            finally:
                rec.on = False
    ops = rec.ops
    counts = gpu_step_counts(ops)
    by_name = collections.Counter(f"{op.kind} {op.name} {op.dtype}".strip() for op in ops)
    by_site = collections.Counter(f"{op.kind} {op.name} {op.site}" for op in ops)
    m = cfg.model
    print(f"bench/gpu_step.py's model: {m.arch}, d {m.d_model}, {m.n_layers} layers, {m.n_heads} heads, r {m.rank}, "
          f"V {m.vocab_size}, T {m.seq_len}, batch {GPU_STEP_BATCH}, bf16, {cfg.parallel.tp_mode} tp {cfg.parallel.tp}, "
          f"recompute {cfg.train.recompute}; one step (forward_backward + AdamW) on the stand-in, meta mode\n")
    print("| launches | count |\n|---|---|")
    for name, n in counts.items():
        print(f"| {name} | {n} |")
    print("\n| kind name dtype | launches |\n|---|---|")
    for key, n in sorted(by_name.items(), key=lambda kv: (-kv[1], kv[0])):
        print(f"| {key} | {n} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"counts": counts, "by_name": dict(by_name), "by_site": dict(by_site)}, f, indent=1)
            f.write("\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=int, default=8, help="divide the 7B's width, vocabulary and T by this")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (run under mpiexec with this many)")
    ap.add_argument("--machine", default="h200", help="a machine profile that rates the attention the step runs (the own kernels: h200, h100-sxm)")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--paper", choices=sorted(PAPER), help="the paper's layout at full size (with --meta)")
    ap.add_argument("--meta", action="store_true", help="the stand-in's shapes-only mode (no values)")
    ap.add_argument("--json", help="--paper: write the result object here; --gpu-step: the counts")
    ap.add_argument("--gpu-step", action="store_true",
                    help="bench/gpu_step.py's model, one step, its launches by kind (with --meta)")
    ap.add_argument("--recompute", choices=("lowrank", "layer", "selective", "none"), default="lowrank",
                    help="--paper: the recompute policy (the paper's is lowrank)")
    ap.add_argument("--tp-mode", choices=("btp", "vanilla"), default="btp",
                    help="without --paper: the layout's tp mode (vanilla: no recompute; with --arch full, Megatron)")
    ap.add_argument("--arch", choices=("cola", "full"), default="cola", help="without --paper: the layout's arch")
    ap.add_argument("--head-dim", type=int, default=128, help="without --paper: the attention's head dim (the 7B's: 128)")
    ap.add_argument("--attention", choices=("auto", "cudnn", "torch", "own"),
                    help="train.attention: the attention backend traced (default: the configuration's)")
    args = ap.parse_args()
    world = None
    if args.gpu_step:
        if not args.meta:
            ap.error("--gpu-step runs the model at full size, which needs --meta")
        gpu_step_report(args)
        return
    if args.paper:
        if not args.meta:
            ap.error("--paper runs at full size, which needs --meta")
        from mpi4py import MPI

        world = MPI.COMM_WORLD
        try:
            paper_report(args, world)
        except SystemExit as exc:
            if world.Get_rank() == 0:
                print(exc, file=sys.stderr)
            sys.exit(2)
        except BaseException:  # noqa: BLE001 - a rank that fails ends every rank, never a hang
            import traceback

            sys.stderr.write(f"rank {world.Get_rank()}: {traceback.format_exc()}")
            sys.stderr.flush()
            world.Abort(1)
        return
    if args.tp > 1:
        from mpi4py import MPI

        world = MPI.COMM_WORLD
        if world.Get_size() != args.tp:
            if world.Get_rank() == 0:
                print(f"error: --tp {args.tp} needs exactly {args.tp} ranks (mpiexec -n {args.tp}), "
                      f"this job has {world.Get_size()}", file=sys.stderr)
            sys.exit(2)
    try:
        report(args, world)
    except BaseException:  # noqa: BLE001 - a rank that fails ends every rank, never a hang
        if world is None:
            raise
        import traceback

        sys.stderr.write(f"rank {world.Get_rank()}: {traceback.format_exc()}")
        sys.stderr.flush()
        world.Abort(1)


def report(args, world):
    from dataclasses import replace

    from boostmpi.sim.machines import load_machine
    from boostmpi.sim.model import comm_bytes, predict, tp_calls
    from boostmpi.sim.operations import shape_of
    from boostmpi.sim.plans import plan_strategy
    from boostmpi.sim.trace import OPTIMIZER_SITE, plan_launches_and_bytes

    machine, tp = load_machine(args.machine), args.tp
    rec = Recorder()
    install(rec)
    layout = (tp, args.tp_mode, args.arch, args.head_dim, args.attention)
    traced = {n: trace_step(rec, config(args.scale, n, *layout), world) for n in (1, 2)}
    if world is not None and world.Get_rank() != 0:
        return
    traces = {n: ops for n, (ops, _) in traced.items()}
    priced = {n: price(ops, machine, tp) for n, ops in traces.items()}
    per_layer = {k: priced[2][k] - priced[1][k] for k in priced[1]}
    extrapolated = {k: priced[1][k] + (LAYERS - 1) * per_layer[k] for k in priced[1]}

    cfg = traced_config(lambda attention: config(args.scale, LAYERS, *layout[:-1], attention), traces[2], args.attention)
    m = cfg.model
    # the model's other attention: score matrices materialised (how the GPU path ran before its fused kernels)
    materialised = replace(machine, attention="matmul")
    analytical = {"profile": predict(cfg, machine).breakdown, "engine": predict(cfg, materialised).breakdown}
    print(f"The paper's 7B layout / {args.scale}: d={m.d_model}, heads={m.n_heads}, d_ff={m.d_ff}, r={m.rank}, "
          f"V={m.vocab_size}, T={m.seq_len}, micro-batch 4, bf16, {args.arch} {args.tp_mode} grouped, recompute {cfg.train.recompute}, tp={tp}; "
          f"traced at 1 and 2 layers on the CuPy stand-in, extrapolated to {LAYERS}; priced on {machine.name}.\n")
    print(f"attention: {_attention_priced_by(traces[2], machine)}\n")
    print("| part | trace-priced s | analytical s (profile: flash attention) | analytical s (scores "
          "materialised) |\n|---|---|---|---|")
    keys = ("gemm", "elementwise", "attention", "tp_comm", "optimizer")
    names = {"gemm": "GEMMs", "elementwise": "elementwise, copies", "attention": "attention core",
             "tp_comm": "tensor-parallel collectives", "optimizer": "optimizer"}

    def cell(breakdown, key):  # a model without an attention entry prices it in its elementwise one
        return f"{breakdown[key]:.4f}" if key in breakdown else "(in elementwise)"

    for key in keys:
        print(f"| {names[key]} | {extrapolated[key]:.4f} | {cell(analytical['profile'], key)} | "
              f"{cell(analytical['engine'], key)} |")
    print(f"| step | {sum(extrapolated[k] for k in keys):.4f} | "
          f"{sum(analytical['profile'].get(k, 0.0) for k in keys):.4f} | "
          f"{sum(analytical['engine'].get(k, 0.0) for k in keys):.4f} |")

    print("\ntensor-parallel payload bytes and calls of one step (rank 0's NCCL calls; the engine's counters "
          "summed over the ranks; sim.model.comm_bytes and tp_calls):")
    for n, (ops, counted) in traced.items():
        calls = [op for op in ops if op.kind == "collective"]
        kinds = ", ".join(f"{sum(op.name == k for op in calls)} {k}" for k in sorted({op.name for op in calls}))
        small = config(args.scale, n, *layout)
        print(f"layers={n}: NCCL {sum(op.nbytes for op in calls)} B in {len(calls)} calls ({kinds or 'none'}), "
              f"engine counters {counted['bytes']['tp']} B in {counted['calls']['tp']} calls, "
              f"model {comm_bytes(small)['tp']} B in {tp_calls(small)} calls")
    s = replace(shape_of(cfg, "flash"), attention="flash")
    launches, gemms, moved = plan_launches_and_bytes(s, plan_strategy(cfg), cfg.train.recompute, 2)
    copies = {n: sum(op.kind == "copy" and not op.site.startswith(OPTIMIZER_SITE) for op in traces[n]) for n in (1, 2)}
    copies = copies[2] - copies[1]
    print(f"\nper layer: {per_layer['launches']:.0f} kernel launches in the trace ({per_layer['gemm_launches']:.0f} "
          f"GEMMs, {copies} copies), {launches} in the analytical plan ({gemms} GEMMs; fused attention); non-GEMM bytes "
          f"{per_layer['elementwise_bytes'] / 1e6:.1f} MB in the trace, {moved / 1e6:.1f} MB in the plan")
    print(f"\nTop {args.top} call sites per layer by priced time (collectives aside; layer 2's share: "
          f"trace(2) - trace(1)):")
    one = {(s, k): (n, nb, sec) for s, k, n, nb, sec in by_site(traces[1], machine, tp)}
    diff = []
    for site, kind, n, nb, sec in by_site(traces[2], machine, tp):
        n1, nb1, s1 = one.get((site, kind), (0, 0, 0.0))
        if n - n1 > 0:
            diff.append((site, kind, n - n1, nb - nb1, sec - s1))
    diff.sort(key=lambda r: -r[4])
    print("| site | kind | launches | MB | priced ms |\n|---|---|---|---|---|")
    for site, kind, n, nb, sec in diff[:args.top]:
        print(f"| {site} | {kind} | {n} | {nb / 1e6:.1f} | {sec * 1e3:.2f} |")


if __name__ == "__main__":
    from boostmpi.errors import UserError

    try:
        main()
    except UserError as exc:  # e.g. a profile without a rate for the attention the step runs: one line
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
