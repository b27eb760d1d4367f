"""The performance model (`boostmpi sim`, `boostmpi calibrate`): bytes, paper check, memory, CLI.

Communication volumes are recomputed here from the formulas of docs/COMMUNICATION.md, written
out independently of the model's operation plans.
"""

import json
from pathlib import Path

import numpy as np
import pytest

from boostmpi.cli import main
from boostmpi.config import config_from_dict
from boostmpi.sim import costs, model, operations, plans
from boostmpi.sim.calibrate import fit_allreduce
from boostmpi.sim.machines import builtin_names, load_machine
from boostmpi.sim.sweep import sweep

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "configs" / "tiny.toml"

# configs/tiny.toml: GQA (4 q heads, 2 kv heads of width 8), rank 8
TINY_MODEL = {"arch": "cola", "vocab_size": 256, "d_model": 32, "n_layers": 2, "n_heads": 4,
              "n_kv_heads": 2, "rank": 8, "d_ff": 64, "seq_len": 16}

PAPER_MODEL = {"d_model": 4096, "d_ff": 11008, "n_layers": 32, "n_heads": 32, "rank": 1024,
               "vocab_size": 32000, "seq_len": 4096}
# the three systems the BOOST paper times (docs/SIM_VALIDATION.md, "The paper check")
PAPER_RUNS = {
    "full": ({"arch": "full"}, {"tp_mode": "vanilla", "grouped": True}, "none", 1.06),
    "vanilla": ({"arch": "cola"}, {"tp_mode": "vanilla", "grouped": False}, "none", 1.64),
    "boost": ({"arch": "cola"}, {"tp_mode": "btp", "grouped": True}, "lowrank", 0.72),
}


def tiny(parallel=None, train=None, model_=None):
    return config_from_dict({"model": {**TINY_MODEL, **(model_ or {})}, "parallel": parallel or {},
                             "train": {"micro_batch_size": 2, **(train or {})}})


def paper_cfg(name):
    arch, parallel, recompute, _ = PAPER_RUNS[name]
    return config_from_dict({"model": {**PAPER_MODEL, **arch}, "parallel": {"tp": 4, **parallel},
                             "train": {"micro_batch_size": 4, "dtype": "bfloat16", "device": "gpu",
                                       "recompute": recompute}})


# ------------------------------------------------------------------ COMMUNICATION.md by hand
def expected_bytes(cfg):
    m, par, t = cfg.model, cfg.parallel, cfg.train
    N, C, F, K, L, p = t.micro_batch_size * m.seq_len, m.d_model, m.d_ff, m.kv_dim, m.n_layers, par.tp
    Ra, Rm, M = m.attn_rank, m.mlp_rank, t.grad_accum
    e = {"float64": 8, "float32": 4, "bfloat16": 2}[t.dtype]
    e_master = 8 if t.dtype == "float64" else 4
    btp = par.tp_mode == "btp" and m.is_lowrank
    stat = 0  # the norm statistics travel in float32 at least (in a bf16 step beside the bf16 products)
    if btp:
        fwd, bwd, stat = N * (4 * Ra + 3 * Rm), N * (4 * Ra + 3 * Rm), 2 * N
        edges = N * C // p + N * C  # all-gather, head backward
    elif m.is_lowrank:
        fwd = N * (3 * C + 2 * K + 2 * F)
        bwd = N * (3 * C + F) if par.grouped else N * (6 * C + F)
        edges = N * C + N * C
    else:
        fwd = 2 * N * C
        bwd = 2 * N * C if par.grouped else 5 * N * C
        edges = N * C + N * C
    if t.recompute == "layer":
        fwd, stat = 2 * fwd, 2 * stat
    cross_entropy = 3 * N * max(e, 4)  # its statistics are reduced in float32 (or float64)
    tp = par.dp * M * ((L * (fwd + bwd) + edges) * e + L * stat * max(e, 4) + cross_entropy) if p > 1 else 0
    shard = C // p if btp else C
    pp = p * par.dp * M * 2 * (par.pp - 1) * N * shard * e
    # dp: every parameter once, plus the tp-replicated ones once more per extra tp rank
    global_params = 2 * m.vocab_size * C + C + L * 2 * C
    for d_in, d_out, r in m.linear_shapes().values():
        global_params += L * (d_in * d_out if r is None else r * (d_in + d_out))
    replicated = C if btp else (2 * L + 1) * C
    dp = (global_params + (p - 1) * replicated) * e_master if par.dp > 1 else 0
    return {"tp": tp, "pp": pp, "dp": dp}


LAYOUTS = [
    ({"tp": 2, "pp": 2, "dp": 2, "tp_mode": "btp"}, {"grad_accum": 3}, {}),
    ({"tp": 2, "tp_mode": "btp", "norm": "sync", "grouped": False}, {"recompute": "layer"}, {}),
    ({"tp": 2, "dp": 3, "tp_mode": "btp"}, {"recompute": "lowrank", "dtype": "float64"}, {"arch": "svd"}),
    ({"tp": 2, "pp": 2, "tp_mode": "vanilla"}, {"grad_accum": 2}, {}),
    ({"tp": 2, "dp": 2, "tp_mode": "vanilla", "grouped": False}, {"recompute": "layer"}, {}),
    ({"tp": 2, "pp": 2, "dp": 2, "tp_mode": "vanilla"}, {}, {"arch": "full"}),
    ({"tp": 2, "tp_mode": "vanilla", "grouped": False}, {"grad_accum": 2}, {"arch": "full"}),
    ({"tp": 1, "pp": 2, "dp": 2}, {}, {}),
    ({"tp": 2, "dp": 2, "tp_mode": "btp"}, {"dtype": "bfloat16", "device": "gpu"}, {"n_kv_heads": 4}),
]


@pytest.mark.parametrize("parallel, train, model_", LAYOUTS)
def test_comm_bytes_follow_communication_md(parallel, train, model_):
    cfg = tiny(parallel, train, model_)
    assert model.comm_bytes(cfg) == expected_bytes(cfg)
    assert model.predict(cfg, load_machine("a100-80gb")).comm_bytes == expected_bytes(cfg)


def test_paper_per_layer_forward_volumes():
    """The paper's forward tp volumes per layer: 2bsd, (5d + 2d_ff)bs, 7bsr (+ the 2bs norm statistics)."""
    bs, d, d_ff, r = 4 * 4096, 4096, 11008, 1024

    def forward_elements(name):
        cfg = paper_cfg(name)
        plan = plans.layer_plan(operations.shape_of(cfg, "flash"), model.tp_strategy(cfg))
        return sum(op.elements for op in plan if isinstance(op, operations.Collective) and op.phase == "fwd")

    assert forward_elements("full") == 2 * bs * d
    assert forward_elements("vanilla") == (5 * d + 2 * d_ff) * bs
    assert forward_elements("boost") == 7 * bs * r + 2 * bs


# ------------------------------------------------------------------ the paper check
def test_paper_times_and_ratios_on_a100():
    machine = load_machine("a100-80gb")
    predicted = {name: model.predict(paper_cfg(name), machine).time_s for name in PAPER_RUNS}
    measured = {name: run[3] for name, run in PAPER_RUNS.items()}
    for name in PAPER_RUNS:
        assert abs(predicted[name] / measured[name] - 1) < 0.15, (name, predicted[name])
    for a, b in (("boost", "full"), ("vanilla", "full"), ("vanilla", "boost")):
        ratio = (predicted[a] / predicted[b]) / (measured[a] / measured[b])
        assert abs(ratio - 1) < 0.10, (a, b, ratio)


# ------------------------------------------------------------------ every machine, arch and mode
ARCH_MODES = [("full", "vanilla"), ("svd", "btp"), ("svd", "vanilla"), ("cola", "btp"), ("cola", "vanilla")]


@pytest.mark.parametrize("machine_name", builtin_names() + ["perlmutter", "polaris", "frontier"])
@pytest.mark.parametrize("arch, mode", ARCH_MODES)
def test_prediction_is_complete(machine_name, arch, mode):
    machine = load_machine(machine_name)
    for recompute in ("none", "layer") + (("lowrank",) if mode == "btp" else ()):
        cfg = tiny({"tp": 2, "pp": 2, "dp": 2, "tp_mode": mode}, {"recompute": recompute},
                   {"arch": arch})
        p = model.predict(cfg, machine)
        assert set(p.breakdown) == set(model.BREAKDOWN_KEYS)
        assert p.time_s == pytest.approx(sum(p.breakdown.values()))
        assert all(v >= 0 for v in p.breakdown.values()) and p.breakdown["gemm"] > 0
        assert p.breakdown["pp_bubble_and_p2p"] > 0 and p.breakdown["dp_comm"] > 0
        assert 0 < p.mfu < 1
        m = p.memory_bytes
        assert m["total"] == m["params"] + m["grads"] + m["optimizer"] + m["activations"]


def test_recompute_trades_time_for_memory():
    machine = load_machine("a100-80gb")
    runs = {rc: model.predict(tiny({"tp": 2}, {"recompute": rc, "micro_batch_size": 8}), machine)
            for rc in ("none", "lowrank", "layer")}
    act = {rc: p.memory_bytes["activations"] for rc, p in runs.items()}
    assert act["layer"] < act["lowrank"] < act["none"]
    assert runs["none"].time_s < runs["lowrank"].time_s < runs["layer"].time_s


def test_lowrank_memory_and_recompute_match_the_engine():
    """lowrank keeps the engine's softmax statistics (so its recompute skips the two row reductions)
    and drops the first stage's first layer input, exactly as the engine's accounting does."""
    from boostmpi.parallel.engine import Engine

    cfg = tiny({"tp": 1}, {"recompute": "lowrank", "dtype": "float32"})
    s = operations.shape_of(cfg, "matmul")
    layer = plans.layer_plan(s, "btp")
    softmax = [op for op in layer if getattr(op, "name", "") == "softmax"]
    again = [op for op in plans.recompute_plan(layer, "lowrank") if getattr(op, "name", "") == "softmax"]
    assert len(softmax) == len(again) == 1 and again[0].fwd_passes == softmax[0].fwd_passes - 2
    kept = s.N * s.C + plans.kept_by_lowrank(layer, s)  # elements per layer, float32
    eng = Engine(cfg)
    x = np.zeros((2, TINY_MODEL["seq_len"]), dtype=np.int64)
    eng.forward_backward([(x, x)])
    assert eng.saved_activation_bytes_per_layer == [(kept - s.N * s.C) * 4, kept * 4]


def test_overlap_hides_dp_communication():
    machine = load_machine("a100-80gb")
    on, off = (model.predict(tiny({"dp": 4, "overlap": o}), machine) for o in (True, False))
    assert 0 < on.breakdown["dp_comm"] < off.breakdown["dp_comm"]


def test_groups_beyond_a_node_use_the_slower_link():
    machine = load_machine("a100-80gb")  # 4 GPUs per node
    inside = costs.group_link(machine, 4, 1)
    across = costs.group_link(machine, 2, 4)  # dp group of tp = 4 replicas: two nodes
    assert inside.bandwidth == machine.intra_node_bandwidth
    assert across.bandwidth == machine.inter_node_bandwidth


def test_small_gemms_lose_efficiency():
    machine = load_machine("a100-80gb")

    def rate(m, n, k):
        return 2 * m * n * k / costs.gemm_seconds(m, n, k, 1, 2, machine, "bfloat16")

    assert rate(8192, 8192, 8192) > rate(16384, 1024, 1024) > rate(16384, 4096, 256) > rate(256, 256, 256)


# ------------------------------------------------------------------ memory
def test_memory_fits_or_not():
    paper = {**PAPER_MODEL, "arch": "full"}
    on_one = config_from_dict({"model": paper, "train": {"micro_batch_size": 4, "dtype": "bfloat16",
                                                         "device": "gpu"}})
    assert not model.predict(on_one, load_machine("a100-40gb")).memory_bytes["fits"]
    assert model.predict(paper_cfg("full"), load_machine("a100-80gb")).memory_bytes["fits"]
    assert model.predict(tiny(), load_machine("a100-40gb")).memory_bytes["fits"]


# ------------------------------------------------------------------ sweep
def test_sweep_ranks_feasible_layouts():
    cfg = tiny(train={"grad_accum": 4})
    rows = sweep(cfg, load_machine("a100-80gb"), 4)
    times = [r["time_s"] for r in rows]
    assert times == sorted(times) and len(rows) > 10
    assert all(r["tp"] * r["pp"] * r["dp"] == 4 and r["fits"] for r in rows)
    # tiny has 2 kv heads: btp cannot split them 4 ways, so the validation drops that layout
    assert not any(r["tp"] == 4 and r["tp_mode"] == "btp" for r in rows)
    assert {r["arch"] for r in rows} == {"full", "svd", "cola"}


# ------------------------------------------------------------------ command line
def test_cli_json(capsys):
    assert main(["sim", "--config", str(TINY), "--machine", "h100-sxm", "--set", "parallel.tp=2",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("time_s", "breakdown", "comm_bytes", "memory_bytes", "mfu"):
        assert key in out
    assert set(out["comm_bytes"]) == {"tp", "pp", "dp"}
    assert out["comm_bytes"] == expected_bytes(tiny({"tp": 2}))


def test_cli_table_plot_and_sweep(capsys, tmp_path):
    png = tmp_path / "b.png"
    assert main(["sim", "--config", str(TINY), "--machine", "frontier", "--plot", str(png)]) == 0
    assert "time per iteration" in capsys.readouterr().out and png.stat().st_size > 0
    assert main(["sim", "--config", str(TINY), "--machine", "polaris", "--sweep", "--gpus", "2"]) == 0
    assert "feasible layouts" in capsys.readouterr().out


def test_bad_machine_name_is_one_line_error(capsys):
    assert main(["sim", "--config", str(TINY), "--machine", "no-such-gpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: unknown machine") and "\n" not in err


def test_profile_missing_key_is_exit_2(capsys, tmp_path):
    text = (ROOT / "boostmpi" / "sim" / "profiles" / "a100-80gb.toml").read_text()
    broken = tmp_path / "broken.toml"
    broken.write_text("\n".join(line for line in text.splitlines()
                                if not line.startswith("gemm_efficiency")))
    assert main(["sim", "--config", str(TINY), "--machine", str(broken)]) == 2
    err = capsys.readouterr().err.strip()
    assert "missing key compute.gemm_efficiency" in err and "\n" not in err


def test_user_profile_and_predict_step_time(tmp_path):
    text = (ROOT / "boostmpi" / "sim" / "profiles" / "a100-80gb.toml").read_text()
    slower = tmp_path / "slow.toml"
    # half the peak, and the attention rates with it (a rate above the profile's peak is refused)
    slower.write_text(text.replace("bfloat16 = 312e12", "bfloat16 = 156e12").replace("171.6e12", "85.8e12"))
    cfg = paper_cfg("full")
    assert model.predict_step_time(cfg, str(slower)) > model.predict_step_time(cfg, "a100-80gb")


# ------------------------------------------------------------------ calibrate
def test_fit_allreduce_recovers_ring_parameters():
    alpha, bw, p = 3e-6, 5e9, 2
    sizes = [8, 1024, 65536, 1 << 20, 1 << 22]
    seconds = [2 * (p - 1) * alpha + 2 * (p - 1) / p * n / bw for n in sizes]
    got_alpha, got_bw = fit_allreduce(sizes, seconds, p)
    assert got_alpha == pytest.approx(alpha, rel=1e-6) and got_bw == pytest.approx(bw, rel=1e-6)


def test_calibrate_writes_a_usable_profile(tmp_path, capsys):
    out = tmp_path / "cpu.toml"
    assert main(["calibrate", "--out", str(out)]) == 0
    machine = load_machine(str(out))
    assert machine.device == "cpu" and machine.attention == "matmul"
    assert machine.peak("float64") > 1e8 and machine.intra_node_bandwidth > 1e7
    assert model.predict_step_time(tiny({"tp": 2}), machine) > 0


def test_a_written_profile_reads_back_exactly(tmp_path):
    """machine_to_toml keeps every digit: each built-in profile, one with a measured rate of many digits and
    one whose description holds quotes, a backslash, a newline and a tab, reads back equal (calibrate and
    the published-run profiles are written through it)."""
    from dataclasses import replace

    from boostmpi.sim.machines import machine_to_toml

    for name in builtin_names():
        machine = load_machine(name)
        odd = replace(machine, description=machine.description + ' "quoted" C:\\path\nsecond line\ttab')
        for version in (machine, replace(machine, memory_bandwidth=machine.memory_bandwidth * (1 + 1e-9) + 0.123), odd):
            path = tmp_path / f"{name}.toml"
            path.write_text(machine_to_toml(version))
            assert load_machine(str(path)) == version, name


def test_split_k_partials_move_in_the_accumulation_type():
    """Split-K's partial tiles are written and read in the accumulation type: 8 bytes for a float64
    GEMM, 4 for float32 and bfloat16. On a machine with compute to spare every GEMM is bound by its
    bytes, which must then be the operands' plus the partials' exactly."""
    from dataclasses import replace

    base = load_machine("a100-80gb")
    machine = replace(base, peak_flops={d: 1e30 for d in base.peak_flops})
    m, n, k = 64, 64, 1 << 20  # one output tile, a long k: split over every unit
    stream = machine.memory_bandwidth * machine.elementwise_efficiency
    split = max(1, min(machine.compute_units, int(k // (4 * machine.gemm_k_overhead)) or 1))
    assert split > 1
    for dtype, itemsize, partial in (("float64", 8, 8), ("float32", 4, 4), ("bfloat16", 2, 4)):
        seconds = costs._gemm_seconds_with_tile(m, n, k, 1, itemsize, machine, dtype, 1, 1, 1.0)
        moved = itemsize * (m * k + k * n + m * n) + (split - 1) * partial * m * n
        assert (seconds - machine.kernel_launch_s) * stream == pytest.approx(moved, rel=1e-12), dtype


# ------------------------------------------------------------------ model FLOPs
def test_model_flops_are_palms_and_the_gpu_bench_uses_them(monkeypatch):
    """6N + 12 L C T per token (PaLM App. B; SC21 Eq. 3 without its recompute pass), and one copy."""
    import importlib.util
    import sys

    cfg = paper_cfg("full")
    m = cfg.model
    K = m.kv_dim
    per_layer = m.d_model * (2 * m.d_model + 2 * K) + 3 * m.d_model * m.d_ff
    N = m.n_layers * per_layer + m.d_model * m.vocab_size
    tokens = cfg.tokens_per_step
    assert model.model_flops_per_step(cfg) == 6 * N * tokens + 12 * m.n_layers * m.d_model * m.seq_len * tokens
    monkeypatch.syspath_prepend(str(ROOT / "bench"))  # gpu_step.py imports its neighbours
    spec = importlib.util.spec_from_file_location("gpu_step", ROOT / "bench" / "gpu_step.py")
    gpu_step = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_step)
    source = (ROOT / "bench" / "gpu_step.py").read_text()
    assert "from boostmpi.sim.model import model_flops_per_step" in source
    assert not hasattr(gpu_step, "model_flops_per_step")  # no second formula at module level


# ------------------------------------------------------------------ across nodes
def test_dp_allreduce_across_nodes_is_hierarchical():
    """Members on one node reduce over NVLink, then each drives its own share of the node's NICs."""
    machine = load_machine("a100-80gb")  # 4 GPUs per node, 25 GB/s of NIC per GPU
    n = 4e9
    intra = costs.Link(machine.intra_node_bandwidth, machine.intra_node_latency)
    inter = costs.Link(machine.inter_node_bandwidth, machine.inter_node_latency)
    # dp = 8 with tp = 1: 4 members per node, 2 nodes
    got = costs.group_allreduce_seconds(n, 8, 1, machine)
    assert got == pytest.approx(costs.allreduce_seconds(n, 4, intra) + costs.allreduce_seconds(n / 4, 2, inter))
    assert got < costs.allreduce_seconds(n, 8, inter)  # a flat ring at NIC speed would be slower
    # tp = 4 fills the node: one member per node, the ring runs at the NIC's speed
    assert costs.group_allreduce_seconds(n, 8, 4, machine) == pytest.approx(costs.allreduce_seconds(n, 8, inter))
    # inside a node: the plain ring over NVLink
    assert costs.group_allreduce_seconds(n, 4, 1, machine) == pytest.approx(costs.allreduce_seconds(n, 4, intra))


# ------------------------------------------------------------------ published runs
# The error bounds recorded in docs/SIM_VALIDATION.md ("Validation against published runs"): a change to the
# model that makes the worst or the median row worse than this fails here.
PUBLISHED_WORST_BOUND = 0.151
PUBLISHED_MEDIAN_BOUND = 0.085


def test_published_runs_within_recorded_bounds():
    from boostmpi.sim import published

    rows = published.validation_table()
    assert len(rows) == 13
    summary = published.summary(rows)
    assert summary["worst"] <= PUBLISHED_WORST_BOUND, published.format_table(rows)
    assert summary["median"] <= PUBLISHED_MEDIAN_BOUND, published.format_table(rows)
    for run, predicted, _ in rows:
        assert run.source and run.assumed and run.derived and predicted > 0


def test_sc21_measured_time_follows_eq3():
    """Table 1's 1T row: 502 PFLOP/s aggregate is 3072 GPUs x 163 TFLOP/s of Eq. 3's FLOPs."""
    from boostmpi.sim import published

    run = published.published_runs()[9]
    flops = published.sc21_flops_per_iteration(3072, 2048, 128, 25600, 51200)
    assert flops / run.measured_s == pytest.approx(502.0e15, rel=0.005)
    assert run.workload.dp == 6 and run.workload.micro_batches == 512


def test_gpt_mlp_is_4h_gelu_without_a_gate():
    """Forward GEMM FLOPs of a GPT layer are SC21's 24 B s h^2 (split t ways), attention aside."""
    from boostmpi.sim import published

    w = published.published_runs()[2].workload  # 7.5B, t = 4
    s = w.shape
    plan = plans.layer_plan(s, "megatron")
    names = [op.name for op in plan]
    assert "gelu" in names and "up" in names and "gate*up" not in names and "gate" not in names
    flops = sum(2 * op.m * op.n * op.k * op.batch for op in plan
                if isinstance(op, operations.Gemm) and op.name not in ("scores", "probs@v"))
    assert flops == 24 * s.N * s.C * s.C // s.p


def test_interleaving_divides_the_bubble():
    from dataclasses import replace

    from boostmpi.sim import published

    run = published.published_runs()[6]  # 145.6B, p = 8, v = 2
    machine = load_machine(run.machine)
    times = {v: model.predict_workload(replace(run.workload, virtual_stages=v), machine) for v in (1, 2)}
    w, e = run.workload, 2
    p2p = costs.p2p_seconds(w.p2p_elements * e, costs.group_link(machine, 2, w.tp))
    for v, p in times.items():
        slot = p.details["forward_s"] + p.details["backward_s"]
        expected = (w.pp - 1) / v * slot + 2 * (v * w.micro_batches + w.pp - 1) * p2p
        assert p.breakdown["pp_bubble_and_p2p"] == pytest.approx(expected)
    assert times[2].breakdown["pp_bubble_and_p2p"] < times[1].breakdown["pp_bubble_and_p2p"]


def test_tp_beyond_a_node_is_hierarchical():
    """tp = 8 on 4-GPU nodes: its all-reduces run over NVLink and then the NICs, not a flat NIC ring."""
    machine = load_machine("a100-80gb")
    s = operations.shape_of(tiny({"tp": 8, "tp_mode": "vanilla"}, model_={"arch": "full", "n_heads": 8,
                                                                      "n_kv_heads": 8}), "flash")
    op = operations.Collective("x", "allreduce", 1 << 24, "fwd")
    t = costs.pass_times([op], False, s, machine, "bfloat16").tp_comm
    assert t == pytest.approx(costs.group_allreduce_seconds(2 << 24, 8, 1, machine))
    inter = costs.Link(machine.inter_node_bandwidth, machine.inter_node_latency)
    assert t < costs.allreduce_seconds(2 << 24, 8, inter)


def test_sweep_explains_the_winner_and_marks_what_does_not_fit(capsys):
    from boostmpi.sim.sweep import PARTS, explain_winner, parts

    rows = sweep(tiny(train={"grad_accum": 4}), load_machine("a100-80gb"), 4, keep_infeasible=True)
    lines = explain_winner(rows)
    assert lines[0].startswith("fastest: ") and lines[1].startswith("margin over #2")
    best, second = rows[0], rows[1]
    assert sum(parts(best["breakdown"]).values()) == pytest.approx(best["time_s"])
    assert f"{second['time_s'] - best['time_s']:.4f} s" in lines[1] and set(PARTS) >= {"compute", "dp comm"}
    # a model too large for 4 GPUs' memory: every layout is listed with --all, marked NO
    big = ["--set", "model.d_model=8192", "--set", "model.n_heads=64", "--set", "model.n_kv_heads=64",
           "--set", "model.n_layers=48", "--set", "model.d_ff=22016", "--set", "model.rank=2048",
           "--set", "model.vocab_size=32000"]
    assert main(["sim", "--config", str(TINY), "--machine", "a100-40gb", "--sweep", "--gpus", "4",
                 "--arch", "full", *big]) == 2
    assert "no layout of this model fits" in capsys.readouterr().err
    assert main(["sim", "--config", str(TINY), "--machine", "a100-40gb", "--sweep", "--gpus", "4",
                 "--arch", "full", "--all", *big]) == 0
    out = capsys.readouterr().out
    assert "0 feasible layouts" in out and " NO" in out and "full" in out and "cola" not in out


@pytest.mark.parametrize("machine_name, gpus", [("polaris", 16), ("frontier", 256), ("perlmutter", 1024)])
def test_sweep_ranks_multi_node_layouts(machine_name, gpus):
    """Layouts across nodes are ranked; dp groups that leave a node pay the NICs."""
    machine = load_machine(machine_name)
    cfg = tiny(train={"grad_accum": gpus})
    rows = sweep(cfg, machine, gpus, archs=["cola"])
    assert rows and all(r["tp"] * r["pp"] * r["dp"] == gpus for r in rows)
    assert [r["time_s"] for r in rows] == sorted(r["time_s"] for r in rows)
    across = [r for r in rows if r["dp"] * r["tp"] * r["pp"] > machine.gpus_per_node and r["dp"] > 1]
    assert across and all(r["breakdown"]["dp_comm"] > 0 for r in across)


# ------------------------------------------------------------------ the GPU step's op trace
def test_trace_pricing_matches_the_cost_model():
    from boostmpi.sim import trace

    machine = load_machine("a100-80gb")
    ops = [trace.TracedOp("gemm", "matmul", "model.layers.x", 0, "bfloat16", (1, 512, 256, 128)),
           trace.TracedOp("elementwise", "add", "model.layers.x", 3 << 20),
           trace.TracedOp("kernel", "rmsnorm", "gpu.kernels._launch", 1 << 20),
           trace.TracedOp("collective", "allReduce", "parallel.x", 1 << 20),
           trace.TracedOp("elementwise", "multiply", "train.optim.step", 1 << 20)]
    p = trace.price(ops, machine, tp=2)
    assert p["gemm"] == pytest.approx(costs.gemm_seconds(512, 256, 128, 1, 2, machine, "bfloat16"))
    assert p["elementwise"] == pytest.approx(costs.pointwise_seconds(4 << 20, 1, 1, machine)
                                             + machine.kernel_launch_s)
    assert p["tp_comm"] == pytest.approx(costs.group_allreduce_seconds(1 << 20, 2, 1, machine))
    assert p["optimizer"] > 0 and p["launches"] == 3 and p["elementwise_bytes"] == 4 << 20


def test_gpu_trace_runs_on_the_standin():
    """bench/gpu_trace.py records a real GPU step (the stand-in) and prices it beside the model."""
    import re
    import subprocess
    import sys

    done = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_trace.py"), "--scale", "32", "--top", "8",
                           "--machine", "h200"],  # a profile that rates the own attention kernels
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    traced, traced_gemms, copies, planned, planned_gemms = _per_layer_counts(done.stdout)
    assert copies == 0
    assert traced_gemms > 0 and "| step |" in done.stdout and "model.layers" in done.stdout
    assert (planned, planned_gemms) == _trace_config_plan()
    _check_plan_states_the_trace(traced, traced_gemms, _trace_config_plan())
    # mutants: the plan with RoPE as one kernel, btp's norm backward without its dw reduction, the
    # attention backward as one kernel, the B factors one GEMM each forward
    for fn, old, new in ((plans.rope, "2 if s.engine_kernels else 1", "1"),
                         (plans.online_norm, "bwd_kernels=2)", "bwd_kernels=1)"),
                         (plans.attention_core, "bwd_kernels=2 if s.engine_kernels else 1", "bwd_kernels=1"),
                         (plans._btp_layer, "batched_fwd=batched", "batched_fwd=False")):
        with pytest.raises(AssertionError):
            _check_plan_states_the_trace(traced, traced_gemms, _trace_config_plan(_mutant(fn, old, new)))


def _per_layer_counts(stdout):
    """(launches, GEMMs, copies, plan launches, plan GEMMs) per layer from bench/gpu_trace.py's report."""
    import re

    m = re.search(r"per layer: (\d+) kernel launches in the trace \((\d+) GEMMs, (\d+) copies\), (\d+) in the "
                  r"analytical plan \((\d+) GEMMs", stdout)
    assert m, stdout
    return tuple(map(int, m.groups()))


def _trace_config_plan(mutant=None, tp=1, tp_mode="btp", arch="cola"):
    """(kernels, GEMMs) per layer of the plan of bench/gpu_trace.py's layout (the 7B / 32)."""
    import contextlib

    from boostmpi.sim.trace import plan_launches_and_bytes

    d = 4096 // 32
    recompute = "lowrank" if tp_mode == "btp" else "none"
    cfg = config_from_dict({"model": {"arch": arch, "d_model": d, "n_heads": tp, "d_ff": 16 * -(-11008 // 32 // 16),
                                      "rank": 1024 // 32, "vocab_size": 1000, "seq_len": 128, "n_layers": 2},
                            "parallel": {"tp": tp, "tp_mode": tp_mode, "grouped": True},
                            "train": {"device": "gpu", "dtype": "bfloat16", "micro_batch_size": 4,
                                      "recompute": recompute}})
    with contextlib.ExitStack() as stack:
        if mutant is not None:
            mp = stack.enter_context(pytest.MonkeyPatch.context())
            mp.setattr(plans, mutant.__name__, mutant)
        return plan_launches_and_bytes(operations.shape_of(cfg, "flash"), plans.plan_strategy(cfg), recompute, 2)[:2]


@pytest.mark.parametrize("arch", ["cola", "full"])
def test_gpu_trace_vanilla_and_megatron_launch_what_the_plan_states(arch):
    """At tp 2, cola vanilla and full-rank Megatron: the GEMMs per layer and the kernels other than
    copies equal the plan's (the copies, concatenations of column blocks the plan does not price,
    are reported apart). The mutants (the RMSNorm backward or the grouped weight gradient counted as
    one kernel) fail the check."""
    import subprocess
    import sys

    from boostmpi.parallel.launch import find_mpiexec

    done = subprocess.run([find_mpiexec(), "-n", "2", sys.executable, str(ROOT / "bench" / "gpu_trace.py"),
                           "--tp", "2", "--scale", "32", "--top", "3", "--tp-mode", "vanilla", "--arch", arch,
                           "--machine", "h200"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    traced, traced_gemms, copies, planned, planned_gemms = _per_layer_counts(done.stdout)
    plan = _trace_config_plan(tp=2, tp_mode="vanilla", arch=arch)
    assert (planned, planned_gemms) == plan
    _check_plan_states_the_trace(traced - copies, traced_gemms, plan)
    for fn, old, new in ((plans.norm, "bwd_kernels=3 if s.gpu else 4", "bwd_kernels=1"),
                         (plans._vanilla_layer if arch == "cola" else plans._megatron_layer,
                          "if s.engine_kernels else 1" if arch == "cola" else "if split else 1", "if False else 1")):
        with pytest.raises(AssertionError):
            mutant = _trace_config_plan(_mutant(fn, old, new), tp=2, tp_mode="vanilla", arch=arch)
            _check_plan_states_the_trace(traced - copies, traced_gemms, mutant)


def _check_plan_states_the_trace(traced, traced_gemms, plan):
    assert (traced, traced_gemms) == plan, ((traced, traced_gemms), plan)


def _mutant(fn, old, new):
    """`fn` compiled from its source with `old` replaced by `new`, in plans' namespace."""
    import inspect
    import textwrap

    src = textwrap.dedent(inspect.getsource(fn))
    mutated = src.replace(old, new)
    assert mutated != src, old
    namespace = {}
    exec(compile(mutated, plans.__file__, "exec"), vars(plans), namespace)  # noqa: S102 - the mutant
    return namespace[fn.__name__]


def test_gpu_trace_at_tp4_records_every_collective():
    """Under mpiexec -n 4 the traced step's NCCL calls, the engine's byte counters and the model's
    comm_bytes agree byte for byte, and the collectives are priced beside the model's."""
    import re
    import subprocess
    import sys

    from boostmpi.parallel.launch import find_mpiexec

    done = subprocess.run([find_mpiexec(), "-n", "4", sys.executable, str(ROOT / "bench" / "gpu_trace.py"),
                           "--tp", "4", "--scale", "32", "--top", "3", "--machine", "h200"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    rows = re.findall(r"layers=(\d): NCCL (\d+) B in (\d+) calls \((.*)\), engine counters (\d+) B in (\d+) calls, "
                      r"model (\d+) B in (\d+) calls", done.stdout)
    assert [r[0] for r in rows] == ["1", "2"], done.stdout
    for _, nccl, calls, kinds, counted, counted_calls, modelled, modelled_calls in rows:
        assert int(nccl) == int(counted) == int(modelled) > 0, done.stdout
        assert int(calls) == int(counted_calls) == int(modelled_calls) > 0, done.stdout
        assert "allReduce" in kinds and "allGather" in kinds
    traced, *analytical = re.search(r"\| tensor-parallel collectives \| (\S+) \| (\S+) \| (\S+) \|",
                                    done.stdout).groups()
    assert float(traced) > 0 and all(float(a) == pytest.approx(float(traced), abs=2e-4) for a in analytical)
    assert "parallel.nccl" not in done.stdout  # call sites name the engine's caller, not the communicator


def _btp_plan_names(layer_plan_fn=None):
    from dataclasses import replace

    s = operations.shape_of(tiny({"tp": 2, "tp_mode": "btp"}, {}, {"arch": "cola"}), "flash")
    fn = layer_plan_fn or plans._btp_layer
    return fn(s), fn(replace(s, eager=True))


def _check_fused_rescale_silu(ops, eager_ops):
    fused = [op for op in ops if op.name == "norm.scale+silu"]
    assert len(fused) == 2 and not [op for op in ops if op.name == "norm.scale"]
    assert all((op.fwd_passes, op.bwd_passes) == (3, 3) for op in fused)
    assert [op.name for op in eager_ops].count("norm.scale") == 2  # eager PyTorch runs them apart


def test_the_btp_plan_counts_the_engines_fused_rescale_and_silu():
    """Under btp with cola a normed group's row rescale and SiLU are one kernel each way in the plan,
    as the engine launches them (btp_rescale_silu, btp_backward_pre). The mutant (the plan with the
    two kernels apart again) fails the check."""
    import inspect
    import textwrap

    _check_fused_rescale_silu(*_btp_plan_names())
    src = textwrap.dedent(inspect.getsource(plans._btp_layer))
    mutant = src.replace("if with_norm_statistic and s.cola and not s.eager:", "if False:")
    assert mutant != src
    namespace = {}
    exec(compile(mutant, plans.__file__, "exec"), vars(plans), namespace)  # noqa: S102 - the mutant
    with pytest.raises(AssertionError):
        _check_fused_rescale_silu(*_btp_plan_names(namespace["_btp_layer"]))


def _engine_and_reference_plans(layer_plan_fn, strategy):
    """The plan of the engine's kernels, of eager PyTorch, and of another framework's fused kernels
    (a published run's shape), for `strategy` on the tiny model at tp 2."""
    from dataclasses import replace

    mode = {"megatron": "vanilla"}.get(strategy, strategy)
    arch = "full" if strategy == "megatron" else "cola"
    s = operations.shape_of(tiny({"tp": 2, "tp_mode": mode, "grouped": True}, {"device": "gpu", "dtype": "bfloat16"},
                            {"arch": arch}), "flash")
    fn = layer_plan_fn or (lambda shape: plans.layer_plan(shape, strategy))
    return fn(s), fn(replace(s, eager=True)), fn(replace(s, engine=False))


def _by_name(ops):
    return {op.name: op for op in ops if isinstance(op, operations.Pointwise)}


def _check_norm_and_attention_kernels(norm_fn=plans.norm):
    """The engine's RMSNorm (vanilla, Megatron, the final norm): forward one kernel of 2 passes;
    backward rmsnorm_projection (dy, x) + rmsnorm_backward (dy, x, dx) = 5 passes, and the dw
    partial sum and its accumulation, one kernel on GPUs (dw_accumulate): 3 kernels (4 on the CPU).
    Another framework's fused norm: 2 / 3 in one kernel."""
    from dataclasses import replace

    s = operations.shape_of(tiny({"tp": 2}, {"device": "gpu"}), "flash")
    op = norm_fn(s, "mlp_norm", 8, 32)
    assert (op.fwd_passes, op.bwd_passes, op.fwd_kernels, op.bwd_kernels) == (2, 5, 1, 3)
    assert norm_fn(replace(s, gpu=False), "mlp_norm", 8, 32).bwd_kernels == 4
    ref = norm_fn(replace(s, engine=False), "mlp_norm", 8, 32)
    assert (ref.fwd_passes, ref.bwd_passes, ref.fwd_kernels, ref.bwd_kernels) == (2, 3, 1, 1)
    for strategy in ("vanilla", "megatron"):
        ops, eager_ops, ref_ops = _engine_and_reference_plans(None, strategy)
        attention = [o for o in ops if isinstance(o, operations.Attention)]
        assert [a.bwd_kernels for a in attention] == [2]  # the dQ pass and the dK/dV pass
        assert [o.bwd_kernels for o in eager_ops + ref_ops if isinstance(o, operations.Attention)] == [1, 1]
        assert _by_name(ops)["mlp_norm"].bwd_kernels == 3 and _by_name(ops)["mlp_norm"].bwd_passes == 5
        assert _by_name(eager_ops)["mlp_norm"].bwd_passes == plans.EAGER_PYTORCH_PASSES["norm"][1]
        assert (_by_name(ref_ops)["mlp_norm"].bwd_passes, _by_name(ref_ops)["residual"].bwd_passes) == (3, 5)


def test_the_plans_price_the_engines_rmsnorm_backward_and_attention_kernels():
    """The engine's plans state the RMSNorm backward's 5 passes in 4 kernels and the attention
    backward's 2 kernels; eager PyTorch's and other frameworks' plans keep theirs. The mutant (the
    norm priced at 3 passes in one kernel again) fails the check."""
    _check_norm_and_attention_kernels()
    with pytest.raises(AssertionError):
        _check_norm_and_attention_kernels(_mutant(plans.norm, "2, 5, saved=saved, bwd_kernels=3 if s.gpu else 4",
                                                  "2, 3, saved=saved"))


def _check_fused_residual_norm(btp_layer=plans._btp_layer):
    """Under btp the MLP's residual add and its norm's first pass are one kernel forward
    (residual_online_stats: reads h, y, writes h + y and its x * w); eager PyTorch and vanilla keep
    the add and the norm apart."""
    ops, eager_ops, _ = _engine_and_reference_plans(btp_layer, "btp")
    assert "residual+mlp_norm" in _by_name(ops)
    fused = _by_name(ops)["residual+mlp_norm"]
    # on GPUs it writes h + y twice: the down projection's GEMM accumulates into the second copy
    assert (fused.fwd_passes, fused.fwd_kernels) == (5, 1) and "mlp_norm" not in _by_name(ops)
    # btp_backward_post (on GPUs adding the gradient from above: no gradient-sum kernel), then the dw
    # sum and its accumulation in one kernel (dw_accumulate)
    assert fused.bwd_kernels == 2 and fused.bwd_passes == 2 + 2 + 1
    assert [o.name for o in ops].count("residual") == 1  # the add after the down projection
    # the add after the down projection is its GEMM's (beta = 1), its gradient sum the attention norm's kernel's
    assert (_by_name(ops)["residual"].fwd_kernels, _by_name(ops)["residual"].bwd_kernels) == (0, 0)
    assert {"residual", "mlp_norm"} <= set(_by_name(eager_ops)) and "residual+mlp_norm" not in _by_name(eager_ops)
    vanilla, _, _ = _engine_and_reference_plans(None, "vanilla")
    assert [o.name for o in vanilla].count("residual") == 2 and "mlp_norm" in _by_name(vanilla)


def test_the_btp_plan_counts_the_engines_fused_residual_and_norm():
    """The btp plan counts residual_online_stats as the one kernel the engine launches, only under
    btp. The mutant (the plan with the add and the norm apart again) fails the check."""
    _check_fused_residual_norm()
    with pytest.raises(AssertionError):
        _check_fused_residual_norm(_mutant(plans._btp_layer, "if not s.engine_kernels:", "if True:"))


def test_the_plan_counts_flashattention2s_traffic_for_the_fused_attention():
    """One head, T = 64 (one tile), head dim 1, bf16, by hand: forward reads Q (128 B) and K, V up to the
    tile's last query (256 B), writes O (128 B) and the float32 log-sum-exp (256 B); backward reads K, V
    (256 B), Q, dO, lse, delta and float32 dQ per query met (64 x 16 B), O and dO for delta and dQ to
    convert (64 x 8 B), writes dK, dV (256 B), dQ in float32 (256 B), delta and dQ converted (64 x 6 B).
    The per-layer plan's non-GEMM bytes include exactly the plan's attention traffic."""
    from boostmpi.sim.trace import plan_launches_and_bytes

    t = operations.flash2_traffic(1, 1, 64, 1, 2)
    assert t == {"forward": (384, 384), "backward": (1280 + 512, 512 + 384)}
    cfg = config_from_dict({"model": {"arch": "cola", "d_model": 128, "n_heads": 4, "n_kv_heads": 2, "rank": 32,
                                      "vocab_size": 1000, "seq_len": 256, "n_layers": 2},
                            "train": {"device": "gpu", "dtype": "bfloat16", "micro_batch_size": 2}})
    s = operations.shape_of(cfg, "flash")
    with_attention = plan_launches_and_bytes(s, plans.plan_strategy(cfg), "none", 2)[2]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(operations.Attention, "traffic", lambda self, itemsize: (0, 0))
        without = plan_launches_and_bytes(s, plans.plan_strategy(cfg), "none", 2)[2]
    t = operations.flash2_traffic(2 * 4, 2 * 2, 256, 32, 2)
    assert with_attention - without == sum(t["forward"]) + sum(t["backward"])
