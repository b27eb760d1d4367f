"""The GPU targets, side by side in one run on one GPU (needs CuPy and a CUDA device; PyTorch
with CUDA for the eager comparison):

  1. RMSNorm kernel bandwidth against a device-to-device copy of the same bytes (target >= 70%),
     and the backward's (no target), at the 7B width [16384, 4096] in bf16 (what training runs)
     and float32;
  2. the GPU's measured bf16 GEMM rate (8192^3);
  3. one training step (forward + backward + AdamW) of a ~350M-parameter cola model (d=1024,
     24 layers, 16 heads, r=256, T=1024, bf16): its model-FLOPs utilisation against (2)
     (target >= 35%), and its time against PyTorch eager on the same model and GPU (target <= 1.0);
  4. the device memory the process holds at the start and after the steps: CuPy's pools, PyTorch's
     allocator and the rest (the CUDA context, kernel modules, library workspaces: what bench/gpu_trace.py's
     outside-pool allowance states without a measurement).

    python bench/gpu_step.py [--batch 8] [--steps 5] [--attention auto|cudnn|torch|own] [--no-eager]
        [--nondeterministic] [--profile] [--skip-kernels] [--graph]

`--nondeterministic` remakes a library attention backend with deterministic=False (what
`train.deterministic = false` runs). `--profile` also records one step with PyTorch's profiler (CUPTI
sees every kernel on the device, CuPy's and cuBLAS's included) and prints where the device time goes,
by kernel, with the step's host time and the GPU-busy fraction: a step whose device time is much less
than its wall time is bound by the host (Python and launches), not by the kernels. `--skip-kernels`
leaves out the RMSNorm lines of (1). `--graph` also times the same step captured in a CUDA graph and
replayed (`train.cuda_graph`, boostmpi/train/graph_step.py: its warm-up steps and the capture first,
untimed), in the same process after the eager step, with its MFU and its ratio to the eager step; with
`--profile` the replayed step is profiled too. A configuration the graph mode refuses prints its line.

`--attention` sets the configuration's `train.attention` (the attention backend the engine runs; left
out, the configuration's default); `--no-eager` leaves out the PyTorch eager step (3), e.g. when
another run of this script on the same GPU measured it.

Written and compiled-checked without a GPU (none was lent when it was written): its first run on a
device is also its test. Model FLOPs are the performance model's (`boostmpi.sim.model.model_flops_per_step`):
PaLM's 6 x (matrix parameters) + 12 x L x d x T per token, the full attention square as PaLM (App. B)
and Narayanan et al. (SC21, Eq. 3) count it, so that MFU here and in `boostmpi sim` is one number.
"""

import argparse
import os
import platform
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # boostmpi and tests.support (the PyTorch reference)


def gpu_time(fn, repeats, warmup=2):
    import cupy

    for _ in range(warmup):
        fn()
    cupy.cuda.Device().synchronize()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for _ in range(repeats):
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop) / 1e3)
    return float(np.median(times))


def rmsnorm_bandwidth(N=16384, C=4096, dtype="float32"):
    """(forward, copy, backward) bytes/s of RMSNorm over [N, C] of `dtype` ("float32" or "bfloat16":
    what training runs); the default is the 7B width, 4 sequences of 4096 tokens."""
    import cupy
    import ml_dtypes

    from boostmpi.gpu import kernels

    storage = ml_dtypes.bfloat16 if dtype == "bfloat16" else cupy.float32
    x = cupy.random.standard_normal((N, C), dtype=cupy.float32).astype(storage)
    w = cupy.ones(C, dtype=cupy.float32).astype(storage)
    y = cupy.empty_like(x)
    moved = 2 * x.nbytes  # read x, write y (w and rstd are negligible)
    t_norm = gpu_time(lambda: kernels.rmsnorm_forward(x, w, 1e-6), 20)
    t_copy = gpu_time(lambda: y.__setitem__(Ellipsis, x), 20)
    # the backward's two kernels read dy and x twice and write dx (kernels/rmsnorm.cu, opening comment)
    rstd = kernels.rmsnorm_forward(x, w, 1e-6)[1]
    t_backward = gpu_time(lambda: kernels.rmsnorm_backward(y, x, w, rstd), 20)
    return moved / t_norm, moved / t_copy, 5 * x.nbytes / t_backward


def gemm_rate(n=8192):
    import cupy
    import ml_dtypes

    a = cupy.random.standard_normal((n, n), dtype=cupy.float32).astype(ml_dtypes.bfloat16)
    b = cupy.random.standard_normal((n, n), dtype=cupy.float32).astype(ml_dtypes.bfloat16)
    return 2 * n ** 3 / gpu_time(lambda: a @ b, 10)


def device_memory(cupy):
    """What this process holds of the device, split: {"in_use": total - free (cudaMemGetInfo), "pools": CuPy's
    pools (boostmpi.gpu.pools.total_bytes), "torch": PyTorch's caching allocator where it is loaded, "rest":
    the remainder: the CUDA context, the loaded kernel modules and the libraries' workspaces (cuBLAS, cuDNN;
    and any other process on the GPU). bench/gpu_trace.py states an allowance for that rest; this measures it."""
    from boostmpi.gpu import pools

    free, total = (int(v) for v in cupy.cuda.runtime.memGetInfo())
    held = pools.total_bytes(cupy)
    torch = sys.modules.get("torch")
    reserved = int(torch.cuda.memory_reserved()) if torch is not None and torch.cuda.is_initialized() else 0
    return {"in_use": total - free, "pools": held, "torch": reserved, "rest": total - free - held - reserved}


def device_memory_line(when, m):
    gb = {k: v / 1e9 for k, v in m.items()}
    return (f"device memory {when}: {gb['in_use']:.2f} GB in use = CuPy's pools {gb['pools']:.2f} + PyTorch's "
            f"allocator {gb['torch']:.2f} + the rest {gb['rest']:.2f} (context, kernel modules, library workspaces)")


def attention_backend_name():
    """The name of the attention backend the engine dispatches to (boostmpi.gpu.attention.current())."""
    try:
        from boostmpi.gpu import attention
    except ImportError:  # before the attention backends: the own kernels
        return "own (no boostmpi.gpu.attention)"
    try:
        backend = attention.current()
        variant = ""
        if backend.name == "own":
            from boostmpi.gpu import tensor_cores

            variant = f", {tensor_cores.ENV}={tensor_cores.setting()}"
        return f"{backend.name} (deterministic: {getattr(backend, 'deterministic', '?')}{variant})"
    except Exception as exc:  # noqa: BLE001 - a name for the record; the step was measured
        return f"unknown ({type(exc).__name__}: {exc})"


def profile_step(fn, flops, peak, top=30):
    """One step of `fn` under PyTorch's profiler: the device time by kernel (name, launches, ms, share),
    the sum of kernel times against the step's wall time, and the MFU the step would have were the
    device busy the whole step (flops / kernel time)."""
    import collections

    import cupy

    try:
        from torch.profiler import ProfilerActivity, profile
    except ImportError as exc:
        print(f"profile: PyTorch's profiler is not importable ({exc})")
        return
    fn()
    cupy.cuda.Device().synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        began = time.perf_counter()
        fn()
        cupy.cuda.Device().synchronize()
        wall = time.perf_counter() - began
    by_name = collections.defaultdict(lambda: [0, 0.0])
    waits = collections.defaultdict(lambda: [0, 0.0])  # host calls that wait for the device, by name
    spans = []
    for event in prof.events():
        if not str(getattr(event, "device_type", "")).endswith("CUDA"):
            if "ynchronize" in event.name or "Memcpy" in event.name and "Async" not in event.name:
                waits[event.name][0] += 1
                waits[event.name][1] += (event.time_range.end - event.time_range.start) / 1e6
            continue
        start, end = event.time_range.start, event.time_range.end
        spans.append((start, end))
        entry = by_name[event.name]
        entry[0] += 1
        entry[1] += (end - start) / 1e6
    if not spans:
        print("profile: the profiler recorded no device kernels (CUPTI unavailable?)")
        return
    busy = sum(entry[1] for entry in by_name.values())
    launches = sum(entry[0] for entry in by_name.values())
    first, last = min(s for s, _ in spans), max(e for _, e in spans)
    print(f"profile: {launches} device activities, kernel time {busy * 1e3:.1f} ms, first-to-last "
          f"{(last - first) / 1e3:.1f} ms, step wall {wall * 1e3:.1f} ms (profiler on): device busy "
          f"{busy / wall:.0%}; MFU at the kernel time {flops / busy / peak:.0%}")
    for name, (count, seconds) in sorted(waits.items()):
        print(f"profile: host waits: {name} {count}x, {seconds * 1e3:.1f} ms")
    for name, (count, seconds) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"profile: {seconds * 1e3:8.2f} ms {seconds / busy:6.1%} {count:5d}x  {name[:110]}")


def graph_step(cfg, eng, opt, mb, t_eager, flops, peak, args):
    """The step as `train.cuda_graph = true` runs it (one rank): warm-up and capture untimed, then replays
    timed as the eager step is (each replay ends with its one read of the loss and the norm)."""
    from boostmpi.train import graph_step as graphs

    problem = graphs.refusal(cfg.replace(**{"train.cuda_graph": True}), eng.grid)
    if problem is not None:
        print(f"graph: refused: {problem}", flush=True)
        return
    graph = graphs.GraphStep(eng, opt, cfg.train.grad_clip)
    began = time.perf_counter()
    for _ in range(graph.warmup + 1):  # the eager warm-up steps, then the capture and its first launch
        graph.step(mb, 1e-4)
    print(f"graph: warm-up ({graph.warmup} eager steps) and capture in {time.perf_counter() - began:.1f} s", flush=True)
    replay = lambda: graph.step(mb, 1e-4)  # noqa: E731
    t_graph = gpu_time(replay, args.steps)
    print(f"boostmpi graph step {t_graph * 1e3:.1f} ms | {flops / t_graph / 1e12:.0f} TFLOP/s | MFU vs measured GEMM "
          f"rate {flops / t_graph / peak:.0%} (target >= 35%) | eager / graph = {t_eager / t_graph:.2f}", flush=True)
    if args.profile:
        profile_step(replay, flops, peak)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--attention", choices=("auto", "cudnn", "torch", "own"),
                    help="train.attention: the attention backend (default: the configuration's)")
    ap.add_argument("--no-eager", action="store_true", help="leave out the PyTorch eager step")
    ap.add_argument("--nondeterministic", action="store_true",
                    help="a library attention backend with deterministic=False (train.deterministic = false)")
    ap.add_argument("--profile", action="store_true", help="where one step's device time goes, by kernel")
    ap.add_argument("--skip-kernels", action="store_true", help="leave out the RMSNorm bandwidth lines")
    ap.add_argument("--graph", action="store_true", help="also the step captured in a CUDA graph and replayed")
    args = ap.parse_args()
    import cupy

    if getattr(cupy, "__standin__", False):
        print("error: bench/gpu_step.py measures a GPU, and this `cupy` is the tests' stand-in (no device: "
              "kernels run on the CPU harness); run it where CuPy reaches a GPU", file=sys.stderr)
        sys.exit(2)

    from boostmpi.config import config_from_dict
    from boostmpi.parallel.engine import Engine
    from boostmpi.sim.model import model_flops_per_step
    from boostmpi.train.optim import AdamW

    props = cupy.cuda.runtime.getDeviceProperties(0)
    print(f"device: {props['name'].decode()} | CuPy {cupy.__version__} | {platform.node()}")
    cupy.zeros(1)  # the context and CuPy's first pool block
    print(device_memory_line("at start", device_memory(cupy)), flush=True)
    for dtype in () if args.skip_kernels else ("bfloat16", "float32"):
        bw_norm, bw_copy, bw_backward = rmsnorm_bandwidth(dtype=dtype)
        print(f"rmsnorm {dtype} [16384, 4096] {bw_norm / 1e9:.0f} GB/s vs copy {bw_copy / 1e9:.0f} GB/s: "
              f"{bw_norm / bw_copy:.0%} (target >= 70%)")
        print(f"rmsnorm {dtype} backward {bw_backward / 1e9:.0f} GB/s over its 5 row transfers: "
              f"{bw_backward / bw_copy:.0%} of copy", flush=True)
    peak = gemm_rate()
    print(f"bf16 GEMM 8192^3: {peak / 1e12:.0f} TFLOP/s")

    model = dict(arch="cola", vocab_size=32000, d_model=1024, n_layers=24, n_heads=16, rank=256, seq_len=1024)
    train = {"device": "gpu", "dtype": "bfloat16", "micro_batch_size": args.batch}
    if args.attention is not None:
        train["attention"] = args.attention
    cfg = config_from_dict({"model": model, "train": train})
    eng = Engine(cfg)
    if args.nondeterministic:
        from boostmpi.gpu import attention

        name = attention.current().name
        if name in attention.LIBRARY_BACKENDS:
            attention.use(attention.make(name, cfg.train.dtype, deterministic=False))
    opt = AdamW(eng.params, eng.specs, cfg.train, eng.xp)
    x = np.random.default_rng(0).integers(0, model["vocab_size"], (args.batch, model["seq_len"] + 1))
    mb = [(x[:, :-1], x[:, 1:])]

    def ours():
        eng.forward_backward(mb)
        opt.step(eng.grads, 1e-4)

    t_ours = gpu_time(ours, args.steps)
    cupy.cuda.Device().synchronize()
    began = time.perf_counter()
    ours()
    issued = time.perf_counter() - began  # the host's time to issue one step (no synchronisation inside)
    cupy.cuda.Device().synchronize()
    print(f"host: one step issued in {issued * 1e3:.1f} ms (the device's step time below; when the two are "
          "close, the host bounds the step)", flush=True)
    print(f"attention: {attention_backend_name()} (train.attention = {args.attention or 'default'})", flush=True)
    flops = model_flops_per_step(cfg)  # one micro-batch of args.batch sequences per step
    print(f"boostmpi step {t_ours * 1e3:.1f} ms | {flops / t_ours / 1e12:.0f} TFLOP/s | MFU vs measured GEMM rate "
          f"{flops / t_ours / peak:.0%} (target >= 35%)")
    print(device_memory_line("after the steps", device_memory(cupy)), flush=True)
    if args.profile:
        profile_step(ours, flops, peak)
    if args.graph:
        graph_step(cfg, eng, opt, mb, t_ours, flops, peak, args)
    if args.no_eager:
        return

    import torch

    from tests.support.torch_llama import TorchLlama

    params = {s.name: cupy.asnumpy(eng.params[s.name]) for s in eng.specs}
    tm = TorchLlama(cfg.to_dict()["model"], params, dtype=torch.bfloat16).cuda()
    topt = torch.optim.AdamW(tm.parameters(), lr=1e-4)
    xt, yt = torch.tensor(x[:, :-1]).cuda(), torch.tensor(x[:, 1:]).cuda()

    def theirs():
        topt.zero_grad()
        tm(xt, yt).backward()
        topt.step()

    for _ in range(2):
        theirs()
    torch.cuda.synchronize()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        theirs()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    t_torch = float(np.median(times))
    print(f"pytorch eager step {t_torch * 1e3:.1f} ms | boostmpi / pytorch = {t_ours / t_torch:.2f} (target <= 1.0)")


if __name__ == "__main__":
    main()
