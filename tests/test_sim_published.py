"""The performance model through its command line: sequence parallelism, ZeRO stages 2 and 3, and
the published runs of docs/SIM.md ("Through the command line"), each predicted by `boostmpi sim`
from a configuration file as a user writes it."""

import json
import statistics

import pytest

from boostmpi.cli import main
from boostmpi.config import config_from_dict
from boostmpi.errors import ConfigError
from boostmpi.sim import model, plans, published
from boostmpi.sim.machines import load_machine

# What docs/SIM.md records for the command-line set; a change that makes either worse fails here.
CLI_WORST_BOUND = 0.26
CLI_MEDIAN_BOUND = 0.099

GPT = {"arch": "full", "vocab_size": 51200, "d_model": 4096, "n_layers": 8, "n_heads": 32, "d_ff": 10944,
       "seq_len": 2048}
BF16 = {"dtype": "bfloat16", "device": "gpu"}


def gpt(parallel=None, train=None):
    return config_from_dict({"model": GPT, "parallel": {"tp_mode": "vanilla", **(parallel or {})},
                             "train": {"micro_batch_size": 1, **BF16, **(train or {})}})


# ------------------------------------------------------------------ every published row through the CLI
RUNS = published.cli_runs()


@pytest.mark.parametrize("run", RUNS, ids=[r.name for r in RUNS])
def test_published_row_runs_through_the_command_line(run, tmp_path, capsys):
    argv = published.cli_argv(run, tmp_path)
    assert argv[:2] == ["sim", "--config"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    # what the command line printed is the model's prediction for the configuration file as written
    from boostmpi.config import load_config

    cfg = load_config(argv[2])
    assert out["time_s"] == pytest.approx(model.predict(cfg, run.profile()).time_s, rel=1e-12)
    assert run.source and run.derived and run.assumed and run.measured_s > 0
    assert out["gpus"] == cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.dp


def test_published_rows_within_recorded_bounds():
    rows = published.cli_validation_table()
    s = published.cli_summary(rows)
    table = published.format_cli_table(rows)
    assert s["worst"] <= CLI_WORST_BOUND, table
    assert s["median"] <= CLI_MEDIAN_BOUND, table
    assert len(s["frameworks"]) >= 3 and {"A100", "H100", "MI250X"} <= set(s["gpus"]), table
    assert statistics.median(abs(e) for _, _, e, _ in rows) == pytest.approx(s["median"])


def test_korthikanti_rows_state_sp_and_selective_recompute():
    rows = {r.name: r for r in RUNS}
    present = rows["GPT 175B SP + selective (t=8, p=8)"].config
    assert present["parallel"]["sequence_parallel"] is True and present["train"]["recompute"] == "selective"
    full = rows["GPT 175B full recompute (t=8, p=8)"].config
    assert "sequence_parallel" not in full["parallel"] and full["train"]["recompute"] == "layer"


# ------------------------------------------------------------------ sequence parallelism
def collective_elements(cfg, phase, kinds=("allreduce",)):
    s = plans.shape_of(cfg, "flash")
    plan = plans.layer_plan(s, model.tp_strategy(cfg))
    return [op for op in plan if isinstance(op, plans.Collective) and op.phase == phase and op.kind in kinds]


def test_sequence_parallel_trades_each_allreduce_for_a_reduce_scatter_and_an_all_gather():
    plain, sp = gpt({"tp": 8}), gpt({"tp": 8, "sequence_parallel": True})
    N, C, p = 2048, 4096, 8
    assert [op.elements for op in collective_elements(plain, "fwd")] == [N * C, N * C]
    assert collective_elements(sp, "fwd") == []
    for phase in ("fwd", "bwd"):
        gathers = collective_elements(sp, phase, ("allgather",))
        scatters = collective_elements(sp, phase, ("reducescatter",))
        assert [op.elements for op in gathers] == [N * C // p] * 2
        assert [op.elements for op in scatters] == [N * C] * 2
    machine = load_machine("a100-80gb-dgx")
    a, b = model.predict(plain, machine), model.predict(sp, machine)
    # ring reduce-scatter + all-gather = one all-reduce: the same communication time
    assert b.breakdown["tp_comm"] == pytest.approx(a.breakdown["tp_comm"], rel=1e-9)
    # norms and residual adds run on N/p tokens
    assert b.breakdown["elementwise"] < a.breakdown["elementwise"]


def test_sequence_parallel_shards_what_full_recompute_keeps_and_the_pipeline_sends():
    machine = load_machine("a100-80gb-dgx")
    layouts = {"tp": 8, "pp": 2}
    train = {"recompute": "layer", "grad_accum": 4}
    a = model.predict(gpt(layouts, train), machine)
    b = model.predict(gpt({**layouts, "sequence_parallel": True}, train), machine)
    assert b.comm_bytes["pp"] * 8 == a.comm_bytes["pp"]
    # Korthikanti et al.: with full recompute a layer keeps 2sbh bytes, sbh/t... per rank under sp
    kept_plain = a.memory_bytes["activations"]
    kept_sp = b.memory_bytes["activations"]
    assert kept_sp < kept_plain / 2


def test_sequence_parallel_needs_megatron_tensor_parallelism():
    with pytest.raises(ConfigError) as err:
        config_from_dict({"model": {"arch": "cola"}, "parallel": {"tp": 2, "sequence_parallel": True}})
    assert "parallel.sequence_parallel" in str(err.value) and "\n" not in str(err.value)


def test_sequence_parallel_mutant_is_caught(monkeypatch):
    """With the sp edges replaced by the plain ones, the collective test fails."""
    monkeypatch.setattr(plans, "_tp_region_edges", lambda s: (
        (lambda name: []), (lambda name: [plans.Collective(f"{name}.y", "allreduce", s.N * s.C, "fwd")])))
    with pytest.raises(AssertionError):
        test_sequence_parallel_trades_each_allreduce_for_a_reduce_scatter_and_an_all_gather()


# ------------------------------------------------------------------ ZeRO stages 2 and 3
def zero_cfg(stage, grad_accum=1, mbs=1, overlap=True):
    return config_from_dict({"model": GPT, "parallel": {"dp": 64, "zero_stage": stage, "overlap": overlap},
                             "train": {"micro_batch_size": mbs, "grad_accum": grad_accum, **BF16}})


def test_zero3_exposes_gathers_per_micro_batch_beyond_one_layer_of_prefetch():
    machine = load_machine("a100-80gb-dgx")  # 64 GPUs: 8 nodes, gathers over the NICs
    one, two = (model.predict(zero_cfg(3, grad_accum=m), machine) for m in (1, 2))
    assert two.breakdown["dp_comm"] == pytest.approx(2 * one.breakdown["dp_comm"])
    # the exposed time is that of zero3_exposed: the first gather and last reduce-scatter at least
    w = model.workload_of(zero_cfg(3))
    assert one.breakdown["dp_comm"] > 0
    # a micro-batch too small to hide a layer's gather exposes the difference, layer by layer
    small = model.predict(zero_cfg(3), machine)
    big = model.predict(zero_cfg(3, mbs=8), machine)
    per_token_small = small.breakdown["dp_comm"] / 1
    per_token_big = big.breakdown["dp_comm"] / 8
    assert per_token_big < per_token_small
    assert w.zero_stage == 3
    # without overlap every gather and reduce-scatter is exposed: more than with prefetching
    assert model.predict(zero_cfg(3, overlap=False), machine).breakdown["dp_comm"] > one.breakdown["dp_comm"]


def test_zero3_prefetch_hides_latency_not_bandwidth():
    slow = {"fwd": type("T", (), {"total": 1.0})(), "bwd": type("T", (), {"total": 2.0})(), "layers": 9}
    # compute-bound: only the first gather and the last unit's gather + reduce-scatter are exposed
    assert model.zero3_exposed(0.5, 0.5, slow, 10, True) == pytest.approx(0.05 + 0.05 + 0.05)
    # bandwidth-bound: a unit costs its communication, not its compute
    exposed = model.zero3_exposed(20.0, 20.0, slow, 10, True)
    assert exposed == pytest.approx(2.0 + 9 * (2.0 - 0.1) + 2.0 + 2.0 + 9 * (4.0 - 0.2))
    assert model.zero3_exposed(1.0, 1.0, slow, 10, False) == 3.0


def test_zero_stage_memory_shards_moments_then_gradients_then_parameters():
    machine = load_machine("a100-80gb")
    mem = {z: model.predict(zero_cfg(z), machine).memory_bytes for z in (0, 1, 2, 3)}
    assert mem[1]["optimizer"] < mem[0]["optimizer"] and mem[1]["grads"] >= mem[0]["grads"]
    assert mem[2]["grads"] < mem[1]["grads"] / 4
    assert mem[3]["params"] < mem[2]["params"] / 2  # its slice + two gathered layers of eight
    assert mem[3]["total"] < mem[2]["total"] < mem[1]["total"] < mem[0]["total"]


def test_zero_mutant_is_caught(monkeypatch):
    """A ZeRO-3 that hides every collective (the old behaviour) fails the exposure test."""
    monkeypatch.setattr(model, "zero3_exposed", lambda *a: 0.0)
    with pytest.raises(AssertionError):
        test_zero3_exposes_gathers_per_micro_batch_beyond_one_layer_of_prefetch()


# ------------------------------------------------------------------ train refuses what only sim prices
SIM_ONLY = {
    "zero stage 2": (["parallel.zero_stage=2"], "parallel.zero_stage = 2"),
    "zero stage 3": (["parallel.zero_stage=3"], "parallel.zero_stage = 3"),
    "sequence parallel": (["parallel.sequence_parallel=true"], "parallel.sequence_parallel"),
}


@pytest.mark.parametrize("overrides,fragment", list(SIM_ONLY.values()), ids=list(SIM_ONLY))
def test_sim_prices_and_train_refuses_in_one_line(overrides, fragment, tmp_path, capfd):
    from train_helpers import TINY_CONFIG, assert_refused, train_argv

    sim = ["sim", "--config", str(TINY_CONFIG), "--machine", "a100-80gb", "--json"]
    for o in overrides:
        sim += ["--set", o]
    assert main(sim) == 0
    assert json.loads(capfd.readouterr().out)["time_s"] > 0
    run_dir = tmp_path / "run"
    shard = tmp_path / "missing.bin"  # refused before any data is read
    line = assert_refused(capfd, train_argv(run_dir, shard, shard, *overrides), tmp_path, fragment, "boostmpi sim")
    assert "train" in line
    assert not run_dir.exists()


def test_sim_only_mutant_is_caught(monkeypatch, tmp_path, capfd):
    """With `sim_only` saying nothing, train no longer refuses ZeRO-3 in one line."""
    from boostmpi.config import Config

    monkeypatch.setattr(Config, "sim_only", lambda self: None)
    with pytest.raises(AssertionError):
        test_sim_prices_and_train_refuses_in_one_line(*SIM_ONLY["zero stage 3"], tmp_path, capfd)


# ------------------------------------------------------------------ the software stack a profile states
def test_profile_states_attention_kernel_and_elementwise_fusion(tmp_path, capsys):
    from dataclasses import replace

    from boostmpi.sim.machines import machine_to_toml

    base = load_machine("a100-80gb-dgx")
    assert base.elementwise == "engine"  # built-in profiles leave the optional key out: boostmpi's kernels
    cfg = gpt({"tp": 8}, {"recompute": "selective"})
    times = {}
    for attention in ("flash", "matmul", "fused_softmax"):
        times[attention] = model.predict(cfg, replace(base, attention=attention))
    # a fused softmax moves the scores fewer times than boostmpi's tiled one, and keeps the probabilities
    assert times["flash"].time_s < times["fused_softmax"].time_s < times["matmul"].time_s
    full = model.predict(gpt({"tp": 8}), replace(base, attention="fused_softmax")).memory_bytes["activations"]
    selective = times["fused_softmax"].memory_bytes["activations"]
    assert full - selective >= 8 * 2048 * 2048 * 4 // 8 * 2  # the probabilities of 4 local heads x 8 layers
    eager = model.predict(cfg, replace(base, elementwise="eager"))
    assert eager.breakdown["elementwise"] > times["flash"].breakdown["elementwise"]
    path = tmp_path / "eager.toml"
    path.write_text(machine_to_toml(replace(base, elementwise="eager")))
    assert load_machine(path).elementwise == "eager"
    path.write_text(machine_to_toml(base).replace('elementwise = "engine"', 'elementwise = "compiled"'))
    config = tmp_path / "c.toml"
    config.write_text(published.toml_text({"model": GPT}))
    assert main(["sim", "--config", str(config), "--machine", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "compute.elementwise must be one of engine, fused, eager" in err and "\n" not in err


def test_sweep_keeps_sim_only_layouts_when_the_configuration_asks_for_them(tmp_path, capsys):
    from boostmpi.sim.sweep import sweep

    machine = load_machine("a100-80gb-dgx")
    rows = sweep(zero_cfg(3), machine, 64, archs=["full"])  # every layout is ZeRO-3: sim only
    assert rows and all(r["tp"] * r["pp"] * r["dp"] == 64 for r in rows)
    config = tmp_path / "gpt.toml"
    config.write_text(published.toml_text({"model": GPT, "parallel": {"tp_mode": "vanilla"},
                                           "train": {"micro_batch_size": 1, **BF16}}))
    argv = ["sim", "--config", str(config), "--machine", "a100-80gb-dgx"]
    for setting in ("parallel.tp=8", "parallel.sequence_parallel=true", "parallel.dp=2", "parallel.zero_stage=3"):
        argv += ["--set", setting]
    assert main(argv) == 0
    assert "sequence parallel, ZeRO-3" in capsys.readouterr().out
