"""Full-rank against CoLA low-rank: one training step each, one process, one thread.

d=1024, 16 heads, d_ff=2736, 4 layers, T=256, vocab 256; cola with r=256. A step is forward +
backward + AdamW update (Engine.forward_backward, AdamW.step), float32. The two models are timed
interleaved round by round in the same process. Target: the cola step at least 1.4x faster.

    PYTHONPATH=. .venv/bin/python bench/full_vs_lowrank.py [--batch 4] [--append bench/log/full_vs_lowrank.md]
"""

import common  # first: one BLAS thread before numpy loads

MODEL = {"vocab_size": 256, "d_model": 1024, "n_layers": 4, "n_heads": 16, "d_ff": 2736,
         "rank": 256, "seq_len": 256}
ARCHS = ("full", "cola")
TARGET_SPEEDUP = 1.4


def main():
    p = common.parser(__doc__.splitlines()[0], warmup=1, repeats=5)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--profile-steps", type=int, default=0, help="also profile this many steps of each model")
    p.add_argument("--top", type=int, default=12)
    args = p.parse_args()
    machine = common.machine_description()

    x, y = common.random_batch(MODEL, args.batch)
    steps, sizes = {}, {}
    for arch in ARCHS:
        model = dict(MODEL, arch=arch)
        _cfg, engine, _opt, step = common.build_engine(model, args.batch)
        steps[arch] = (lambda step=step: step(x, y))
        sizes[arch] = sum(s.local_numel for s in engine.specs)

    timings = common.time_interleaved(steps, args.warmup, args.repeats)
    tokens = args.batch * MODEL["seq_len"]
    rows = [[arch, f"{sizes[arch] / 1e6:.2f}", *common.timing_cells(timings, arch),
             f"{tokens / timings.median(arch):.0f}"] for arch in ARCHS]
    speedup = timings.median("full") / timings.median("cola")
    summary = (f"Model: {MODEL} (rank used by cola only), batch {args.batch}, float32; {args.warmup} warm-up "
               f"round(s), median of {args.repeats} interleaved timed rounds.\n\n"
               + common.markdown_table(["arch", "parameters (M)", *common.TIMING_HEADER, "tokens/s"], rows)
               + f"\n\n**full / cola step time = {speedup:.2f}x** (ratio of medians; target >= {TARGET_SPEEDUP}x: "
               f"{common.verdict(speedup >= TARGET_SPEEDUP)}). Median of the per-round ratios: wall "
               f"{timings.paired_ratio('full', 'cola'):.2f}x, CPU time {timings.paired_ratio('full', 'cola', 'cpu'):.2f}x.")
    sections = [summary]
    if args.profile_steps > 0:
        sections += [common.step_profile_section(f"{arch} step profile", steps[arch], args.profile_steps, args.top)
                     for arch in ARCHS]
    common.emit("full_vs_lowrank: full-rank vs cola training step", machine, sections, args.append)


if __name__ == "__main__":
    main()
