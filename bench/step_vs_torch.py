"""One training step of boostmpi's NumPy path against PyTorch CPU eager (issue 2).

Same model (cola, d=512, 4 layers, 8 heads, r=128, d_ff=1376, T=256, vocab 256), same weights
(taken from the engine), same batch, float32, one thread each, in one process, interleaved
round by round. A step is forward + backward + AdamW update on both sides:
  boostmpi: Engine.forward_backward([(x, y)]) then AdamW.step(grads, lr)
  torch:    zero_grad, loss = model(x, y), loss.backward(), torch.optim.AdamW.step()
with the same AdamW hyper-parameters and the same decayed set (matrices yes, norm weights no),
and a constant learning rate on both sides. Target: boostmpi / torch <= 1.0.

Then a profile of boostmpi's step (phases and hot spots from cProfile) and of torch's
(phases timed in the step, hot operators from torch.profiler), for whoever optimises next.

    PYTHONPATH=. .venv/bin/python bench/step_vs_torch.py [--append bench/RESULTS.md]
"""

import common  # noqa: F401 - first: one BLAS thread before numpy loads

import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import asdict  # noqa: E402

import numpy as np  # noqa: E402

from common import REPO  # noqa: E402

sys.path.insert(0, str(REPO / "tests"))

MODEL = {"arch": "cola", "vocab_size": 256, "d_model": 512, "n_layers": 4, "n_heads": 8,
         "rank": 128, "d_ff": 1376, "seq_len": 256}
LR = 1e-3


def build_boostmpi(model, batch):
    from boostmpi.config import config_from_dict
    from boostmpi.parallel.engine import Engine
    from boostmpi.train.optim import AdamW

    cfg = config_from_dict({"model": model, "train": {"micro_batch_size": batch, "dtype": "float32"}}, world_size=1)
    engine = Engine(cfg)
    return cfg, engine, AdamW(engine.params, engine.specs, cfg.train)


def build_torch(torch, cfg, engine):
    """The reference model holding the engine's initial weights, and its AdamW set up like ours."""
    from torch_llama import TorchLlama

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

    cfg, engine, opt = build_boostmpi(MODEL, args.batch)
    model, topt = build_torch(torch, cfg, engine)
    rng = np.random.default_rng(0)
    x = rng.integers(0, MODEL["vocab_size"], size=(args.batch, MODEL["seq_len"]))
    y = rng.integers(0, MODEL["vocab_size"], size=(args.batch, MODEL["seq_len"]))
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
        opt.step(engine.grads, LR)
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

    times = common.time_interleaved({"boostmpi": boost_step, "torch": torch_step}, args.warmup, args.repeats)
    med = {name: common.median(ts) for name, ts in times.items()}
    ratio = med["boostmpi"] / med["torch"]
    tokens = args.batch * MODEL["seq_len"]

    rows = [[name, f"{1e3 * med[name]:.0f}", common.spread(times[name]), f"{tokens / med[name]:.0f}",
             ", ".join(f"{ph} {1e3 * common.median(v[args.warmup:]):.0f}" for ph, v in phases[name].items())]
            for name in ("boostmpi", "torch")]
    table = common.markdown_table(["implementation", "step ms (median)", "min-max ms", "tokens/s", "phases, ms (median)"], rows)
    summary = (f"Model: {MODEL}, batch {args.batch}, float32; {args.warmup} warm-up rounds, median of "
               f"{args.repeats} interleaved timed rounds.\n\n{table}\n\n"
               f"**boostmpi / torch step time = {ratio:.2f}** (target <= 1.0: {common.verdict(ratio <= 1.0)}).\n\n"
               f"Same model check: loss before any update boostmpi {loss0_boost:.6f}, torch {loss0_torch:.6f}; "
               f"after {args.warmup + args.repeats} identical steps boostmpi {last['boostmpi']:.6f}, torch {last['torch']:.6f}.")
    sections = [summary]
    if args.profile_steps > 0:
        sections += profile_sections(torch, engine, opt, model, topt, x, y, xt, yt, args)
    common.emit("step_vs_torch: one training step, boostmpi NumPy vs PyTorch CPU eager", machine, sections, args.append)


def profile_sections(torch, engine, opt, model, topt, x, y, xt, yt, args):
    steps = args.profile_steps

    def boost_step():
        engine.forward_backward([(x, y)])
        opt.step(engine.grads, LR)

    stats = common.profile(boost_step, steps)
    per_step = stats.total_tt / steps
    phase_rows = []
    for label, fn, path in (("forward (embedding, blocks, head + loss)", "_stage_forward", "parallel/engine.py"),
                            ("backward (head, blocks, embedding)", "_stage_backward", "parallel/engine.py"),
                            ("optimizer (AdamW)", "step", "train/optim.py")):
        seconds = common.profile_cumulative(stats, fn, path)
        cell = "n/a" if seconds is None else f"{1e3 * seconds / steps:.0f}"
        share = "" if seconds is None else f"{100 * seconds / stats.total_tt:.0f}%"
        phase_rows.append([label, cell, share])
    phase_rows.append(["whole step under the profiler", f"{1e3 * per_step:.0f}", "100%"])
    boost = (f"### boostmpi step profile (cProfile, {steps} steps)\n\n"
             + common.markdown_table(["phase", "ms/step", "share"], phase_rows)
             + f"\n\nTop {args.top} functions by own time (a matrix product counts in the function that writes it):\n\n"
             + common.profile_hot_spots(stats, steps, args.top))

    def torch_step():
        topt.zero_grad()
        model(xt, yt).backward()
        topt.step()

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            torch_step()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:args.top]
    total_us = sum(e.self_cpu_time_total for e in prof.key_averages())
    rows = [[f"`{e.key}`", f"{e.count / steps:.0f}", f"{e.self_cpu_time_total / 1e3 / steps:.1f}",
             f"{100 * e.self_cpu_time_total / max(total_us, 1):.1f}%"] for e in events]
    torch_part = (f"### torch step profile (torch.profiler, {steps} steps)\n\n"
                  + common.markdown_table(["operator", "calls/step", "self ms/step", "self share"], rows))
    return [boost, torch_part]


if __name__ == "__main__":
    main()
