"""The engine's own GPU step, op by op, priced with a machine profile, beside the analytical model.

One training step (forward_backward + AdamW) of the GPU path runs on the CuPy stand-in
(tests/cupy_standin) with a recorder around it: every GEMM (shape, dtype), every other kernel
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

    python bench/gpu_trace.py [--scale 8] [--machine a100-80gb] [--top 12]
    mpiexec -n 4 python bench/gpu_trace.py --tp 4 [--scale 8] ...
"""

import common  # noqa: F401 - first: one BLAS thread before numpy loads

import argparse  # noqa: E402
import inspect  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import warnings  # noqa: E402

from common import REPO  # noqa: E402

os.environ["BOOSTMPI_CUPY_STANDIN"] = "1"
sys.path.insert(0, str(REPO / "tests"))
import gpu_setup  # noqa: E402,F401 - puts the stand-in first on sys.path

import numpy as np  # noqa: E402

from boostmpi.sim.trace import TracedOp, price  # noqa: E402

LAYERS = 32
# modules whose frames are skipped when naming the call site: the array module, the kernels'
# wrappers (a launch is named by the model function that asked for it), and the communicators a
# collective passes through on its way to NCCL
INTERNAL = ("backend.py", "gpu/kernels.py", "parallel/comm.py", "parallel/nccl.py")


# ---------------------------------------------------------------- the recorder
class Recorder:
    def __init__(self):
        self.ops, self.depth, self.on = [], 0, False

    def site(self):
        for frame in inspect.stack()[2:]:
            path = frame.filename
            if "/boostmpi/" in path and not path.endswith(INTERNAL):
                module = path.split("/boostmpi/")[-1].removesuffix(".py").replace("/", ".")
                return f"{module}.{frame.function}"
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
                recorder.ops.append(TracedOp(site=recorder.site(), **fields))
            return result

        setattr(owner, attr, wrapper)


def _nbytes(x):
    import cupy

    return x.nbytes if isinstance(x, cupy.ndarray) else 0


def install(rec):
    import cupy
    from cupy import _kernel
    from cupy.cuda import nccl

    def ufunc_call(result, self, *args, out=None, **kw):
        written = _nbytes(out if out is not None else result)
        read = sum(_nbytes(a) for a in args[:self.nin])
        return dict(kind="elementwise", name=self.__name__, nbytes=read + written, dtype=str(result.dtype))

    def reduction(result, kind, a, *args, **kw):
        return dict(kind="reduction", name=kind, nbytes=a.nbytes + _nbytes(result), dtype=str(a.dtype))

    def gemm(result, a, b, *args, **kw):
        m, k = a.shape[-2:]
        n = b.shape[-1]
        batch = int(np.prod(result.shape[:-2])) if result.ndim > 2 else 1
        return dict(kind="gemm", name="matmul", nbytes=a.nbytes + b.nbytes + result.nbytes,
                    dtype=str(result.dtype), gemm=(batch, m, n, k))

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
            return dict(kind="collective", name=name, nbytes=count * nccl._dtype(datatype).itemsize, dtype="")
        return describe

    rec.wrap(cupy.ufunc, "__call__", ufunc_call)
    rec.wrap(cupy, "_reduce", reduction)
    rec.wrap(cupy, "matmul", gemm)
    cupy.dot = cupy.matmul
    cupy.ndarray.__matmul__ = lambda self, other: cupy.matmul(self, other)
    for name in ("copy", "astype"):
        rec.wrap(cupy.ndarray, name, copy(name))
    for name in ("ascontiguousarray", "concatenate", "stack", "where", "array"):
        rec.wrap(cupy, name, copy(name))
    rec.wrap(cupy.ndarray, "__getitem__", getitem)
    rec.wrap(cupy.ndarray, "__setitem__", setitem)
    rec.wrap(cupy.ndarray, "fill", fill)
    for name in ("zeros", "zeros_like"):
        rec.wrap(cupy, name, memset)
    # the fused kernels: recorded with what their arguments move, not executed
    _kernel.RawKernel.__call__ = lambda self, grid, block, args, **kw: None
    rec.wrap(_kernel.RawKernel, "__call__", kernel)
    for name in ("allReduce", "allGather", "broadcast", "send", "recv"):
        rec.wrap(nccl.NcclCommunicator, name, collective(name))


# T x T x Dh products each attention kernel computes: the forward QK^T and PV; the dQ pass QK^T,
# dO V^T and dS K; the dK/dV pass QK^T, dO V^T, P^T dO and dS^T Q
ATTENTION_PRODUCTS = {"attention_forward": 2, "attention_backward_dq": 3, "attention_backward": 4}
ATTENTION_TRAFFIC = {"attention_forward": "forward", "attention_backward_dq": "backward_dq",
                     "attention_backward": "backward_dkdv"}


def attention_kernel(name, args):
    """A fused attention launch: the bytes of its tile plan, and its causal FLOPs in float32 (the
    kernels use FMAs, not tensor cores, and compute over all 128 dims of a tile whatever Dh is)."""
    from boostmpi.gpu import kernels

    entry = name.rsplit("_", 1)[0]
    q, k = args[0], args[1]
    B, T, H, Dh = q.shape
    read, written = kernels.attention_traffic(B, T, H, k.shape[2], Dh, q.itemsize)[ATTENTION_TRAFFIC[entry]]
    flops = ATTENTION_PRODUCTS[entry] * 2.0 * B * H * T * (T + 1) / 2 * kernels.ATTENTION_HEAD_DIM_MAX
    return dict(kind="attention", name=name, nbytes=read + written, dtype="float32", flops=flops)


# ---------------------------------------------------------------- the step
def config(scale, layers, tp=1):
    from boostmpi.config import config_from_dict

    d = 4096 // scale
    model = dict(arch="cola", d_model=d, n_heads=max(d // 128, tp), d_ff=16 * -(-11008 // scale // 16),
                 rank=1024 // scale, vocab_size=32000 // scale, seq_len=4096 // scale, n_layers=layers)
    return config_from_dict({"model": model, "parallel": {"tp": tp, "tp_mode": "btp", "grouped": True},
                             "train": {"device": "gpu", "dtype": "bfloat16", "micro_batch_size": 4,
                                       "recompute": "lowrank"}})


def trace_step(rec, cfg, world=None):
    """(ops this rank launched, the engine's counters {"bytes"|"calls": per axis} summed over the ranks) of one step."""
    from boostmpi.parallel.comm import AXES
    from boostmpi.parallel.engine import Engine
    from boostmpi.train.optim import AdamW

    eng = Engine(cfg, world, local_rank=0 if world is None else world.Get_rank())
    if world is not None and not eng.grid.use_nccl:
        raise RuntimeError("a multi-rank GPU run did not choose NCCL")
    eng.grid.counter.reset()
    opt = AdamW(eng.params, eng.specs, cfg.train, eng.xp)
    rng = np.random.default_rng(0)
    shape = (cfg.train.micro_batch_size, cfg.model.seq_len)
    batch = [(rng.integers(0, cfg.model.vocab_size, shape), rng.integers(0, cfg.model.vocab_size, shape))]
    rec.ops, rec.on = [], True
    try:
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            eng.forward_backward(batch)
            opt.step(eng.grads, 1e-4)
    finally:
        rec.on = False
    counter = eng.grid.counter
    counted = np.array([counter.bytes[a] for a in AXES] + [counter.calls[a] for a in AXES], dtype=np.int64)
    if world is not None:
        from mpi4py import MPI

        world.Allreduce(MPI.IN_PLACE, counted, op=MPI.SUM)
        for group in (eng.grid.tp, eng.grid.pp, eng.grid.dp):
            if group.comm is not None:
                group.comm.Free()
    counted = counted.tolist()
    return list(rec.ops), {"bytes": dict(zip(AXES, counted[:3])), "calls": dict(zip(AXES, counted[3:]))}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=int, default=8, help="divide the 7B's width, vocabulary and T by this")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (run under mpiexec with this many)")
    ap.add_argument("--machine", default="a100-80gb")
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    world = None
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
    from boostmpi.sim.plans import plan_strategy, shape_of
    from boostmpi.sim.trace import by_site, plan_launches_and_bytes

    machine, tp = load_machine(args.machine), args.tp
    rec = Recorder()
    install(rec)
    traced = {n: trace_step(rec, config(args.scale, n, tp), world) for n in (1, 2)}
    if world is not None and world.Get_rank() != 0:
        return
    traces = {n: ops for n, (ops, _) in traced.items()}
    priced = {n: price(ops, machine, tp) for n, ops in traces.items()}
    per_layer = {k: priced[2][k] - priced[1][k] for k in priced[1]}
    extrapolated = {k: priced[1][k] + (LAYERS - 1) * per_layer[k] for k in priced[1]}

    cfg = config(args.scale, LAYERS, tp)
    m = cfg.model
    # the model's other attention: score matrices materialised (how the GPU path ran before its fused kernels)
    materialised = replace(machine, attention="matmul")
    analytical = {"profile": predict(cfg, machine).breakdown, "engine": predict(cfg, materialised).breakdown}
    print(f"The paper's 7B layout / {args.scale}: d={m.d_model}, heads={m.n_heads}, d_ff={m.d_ff}, r={m.rank}, "
          f"V={m.vocab_size}, T={m.seq_len}, micro-batch 4, bf16, cola btp grouped, recompute lowrank, tp={tp}; "
          f"traced at 1 and 2 layers on the CuPy stand-in, extrapolated to {LAYERS}; priced on {machine.name}.\n")
    print("| part | trace-priced s | analytical s (profile: flash attention) | analytical s (scores "
          "materialised) |\n|---|---|---|---|")
    for key, name in (("gemm", "GEMMs"), ("elementwise", "elementwise, attention core, copies"),
                      ("tp_comm", "tensor-parallel collectives"), ("optimizer", "optimizer")):
        print(f"| {name} | {extrapolated[key]:.4f} | {analytical['profile'][key]:.4f} | "
              f"{analytical['engine'][key]:.4f} |")
    keys = ("gemm", "elementwise", "optimizer", "tp_comm")
    print(f"| step | {sum(extrapolated[k] for k in keys):.4f} | {sum(analytical['profile'][k] for k in keys):.4f} | "
          f"{sum(analytical['engine'][k] for k in keys):.4f} |")

    print("\ntensor-parallel payload bytes and calls of one step (rank 0's NCCL calls; the engine's counters "
          "summed over the ranks; sim.model.comm_bytes and tp_calls):")
    for n, (ops, counted) in traced.items():
        calls = [op for op in ops if op.kind == "collective"]
        kinds = ", ".join(f"{sum(op.name == k for op in calls)} {k}" for k in sorted({op.name for op in calls}))
        small = config(args.scale, n, tp)
        print(f"layers={n}: NCCL {sum(op.nbytes for op in calls)} B in {len(calls)} calls ({kinds or 'none'}), "
              f"engine counters {counted['bytes']['tp']} B in {counted['calls']['tp']} calls, "
              f"model {comm_bytes(small)['tp']} B in {tp_calls(small)} calls")
    s = replace(shape_of(cfg, "flash"), attention="flash")
    launches, gemms, moved = plan_launches_and_bytes(s, plan_strategy(cfg), cfg.train.recompute, 2)
    print(f"\nper layer: {per_layer['launches']:.0f} kernel launches in the trace ({per_layer['gemm_launches']:.0f} "
          f"GEMMs), {launches} in the analytical plan ({gemms} GEMMs; fused attention); non-GEMM bytes "
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
    main()
