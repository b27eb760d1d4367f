"""One training step of boostmpi's NumPy path against PyTorch CPU eager.

Same model (cola, d=512, 4 layers, 8 heads, r=128, d_ff=1376, T=256, vocab 256), same weights
(taken from the engine), same batch, float32, one thread each, in one process, interleaved
round by round. A step is forward + backward + AdamW update on both sides:
  boostmpi: Engine.forward_backward([(x, y)]) then AdamW.step(grads, lr)
  torch:    zero_grad, loss = model(x, y), loss.backward(), torch.optim.AdamW.step()
with the same AdamW hyper-parameters and the same decayed set (matrices yes, norm weights no),
and a constant learning rate on both sides. Target: boostmpi / torch <= 1.0.

Then a profile of boostmpi's step (phases and hot spots from cProfile) and of torch's
(phases timed in the step, hot operators from torch.profiler), for whoever optimises next.

    PYTHONPATH=. .venv/bin/python bench/step_vs_torch.py [--append bench/log/step_vs_torch.md]
"""

import common  # first: one BLAS thread before numpy loads

import time  # noqa: E402
from dataclasses import asdict  # noqa: E402

import numpy as np  # noqa: E402

from common import REPO  # noqa: E402,F401 - the repository root on sys.path (tests.support)

MODEL = {"arch": "cola", "vocab_size": 256, "d_model": 512, "n_layers": 4, "n_heads": 8,
         "rank": 128, "d_ff": 1376, "seq_len": 256}
LR = common.LR


def build_torch(torch, cfg, engine):
    """The reference model holding the engine's initial weights, and its AdamW set up like ours."""
    from tests.support.torch_llama import TorchLlama

    params = {s.name: np.array(engine.params[s.name]) for s in engine.specs}
    model = TorchLlama(asdict(cfg.model), params, torch.float32).train()
    tr = cfg.train
    decayed = {s.name for s in engine.specs if s.decay}
    groups = [{"params": [p for n, p in model.weights.items() if n in decayed], "weight_decay": tr.weight_decay},
              {"params": [p for n, p in model.weights.items() if n not in decayed], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=LR, betas=(tr.beta1, tr.beta2), eps=tr.adam_eps)
    return model, opt


def main():
    p = common.parser(__doc__.splitlines()[0], warmup=2, repeats=7)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--profile-steps", type=int, default=2, help="steps profiled after the timing (0 = no profile)")
    p.add_argument("--top", type=int, default=15, help="hot spots listed per profile")
    args = p.parse_args()
    torch = common.torch_single_thread()
    machine = common.machine_description(torch=torch)

    cfg, engine, opt, train_step = common.build_engine(MODEL, args.batch)
    model, topt = build_torch(torch, cfg, engine)
    x, y = common.random_batch(MODEL, args.batch)
    xt, yt = torch.as_tensor(x), torch.as_tensor(y)

    # same model, same weights: the losses before any update must agree to float32 rounding
    with torch.no_grad():
        loss0_torch = model(xt, yt).item()
    loss0_boost = engine.forward_backward([(x, y)])

    last = {}
    phases = {"boostmpi": {"forward+backward": [], "optimizer": []},
              "torch": {"forward": [], "backward": [], "optimizer": []}}

    def boost_step():
        t0 = time.perf_counter()
        last["boostmpi"] = engine.forward_backward([(x, y)])
        t1 = time.perf_counter()
        opt.step(engine.grads, LR)  # train_step(x, y) without the split into phases
        t2 = time.perf_counter()
        phases["boostmpi"]["forward+backward"].append(t1 - t0)
        phases["boostmpi"]["optimizer"].append(t2 - t1)

    def torch_step():
        t0 = time.perf_counter()
        topt.zero_grad()
        loss = model(xt, yt)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        topt.step()
        t3 = time.perf_counter()
        last["torch"] = loss.item()
        for name, dt in (("forward", t1 - t0), ("backward", t2 - t1), ("optimizer", t3 - t2)):
            phases["torch"][name].append(dt)

    timings = common.time_interleaved({"boostmpi": boost_step, "torch": torch_step}, args.warmup, args.repeats)
    ratio = timings.median("boostmpi") / timings.median("torch")
    tokens = args.batch * MODEL["seq_len"]

    rows = [[name, *common.timing_cells(timings, name), f"{tokens / timings.median(name):.0f}",
             ", ".join(f"{ph} {1e3 * common.median(v[args.warmup:]):.0f}" for ph, v in phases[name].items())]
            for name in ("boostmpi", "torch")]
    table = common.markdown_table(["implementation", *common.TIMING_HEADER, "tokens/s", "phases, wall ms (median)"], rows)
    summary = (f"Model: {MODEL}, batch {args.batch}, float32; {args.warmup} warm-up rounds, median of "
               f"{args.repeats} interleaved timed rounds.\n\n{table}\n\n"
               f"**boostmpi / torch step time = {ratio:.2f}** (ratio of medians; target <= 1.0: "
               f"{common.verdict(ratio <= 1.0)}). Median of the per-round ratios: wall "
               f"{timings.paired_ratio('boostmpi', 'torch'):.2f}, CPU time "
               f"{timings.paired_ratio('boostmpi', 'torch', 'cpu'):.2f}.\n\n"
               f"Same model check: loss before any update boostmpi {loss0_boost:.6f}, torch {loss0_torch:.6f}; "
               f"after {args.warmup + args.repeats} identical steps boostmpi {last['boostmpi']:.6f}, torch {last['torch']:.6f}.")
    sections = [summary]
    if args.profile_steps > 0:
        sections += profile_sections(torch, train_step, model, topt, x, y, xt, yt, args)
    common.emit("step_vs_torch: one training step, boostmpi NumPy vs PyTorch CPU eager", machine, sections, args.append)


def profile_sections(torch, train_step, model, topt, x, y, xt, yt, args):
    steps = args.profile_steps
    boost = common.step_profile_section("boostmpi step profile", lambda: train_step(x, y), steps, args.top)

    def torch_step():
        topt.zero_grad()
        model(xt, yt).backward()
        topt.step()

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            torch_step()
    averages = prof.key_averages()
    total_us = max(sum(e.self_cpu_time_total for e in averages), 1)
    events = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)[:args.top]
    rows = [[f"`{e.key}`", f"{e.count / steps:.0f}", f"{e.self_cpu_time_total / 1e3 / steps:.1f}",
             f"{100 * e.self_cpu_time_total / total_us:.1f}%"] for e in events]
    torch_part = (f"### torch step profile (torch.profiler, wall time, {steps} steps)\n\n"
                  + common.markdown_table(["operator", "calls/step", "self ms/step", "self share"], rows))
    return [boost, torch_part]


if __name__ == "__main__":
    main()
