"""`boostmpi sim`'s attention: per-backend rate tables in every profile, the own kernels' shape model
against the H200 table, and the profile checks and sim-side operations cases (one line, exit 2)."""

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from boostmpi.cli import main
from boostmpi.config import config_from_dict
from boostmpi.sim import attention_rates, model
from boostmpi.sim.attention_rates import causal_flops, tile_efficiency
from boostmpi.sim.machines import attention_rate, builtin_names, load_machine

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "configs" / "tiny.toml"

# bench/log/attention.md, "the own kernels against cuDNN and PyTorch SDPA on one H200 (2026-11)":
# (B, T, H, Hkv, Dh) -> milliseconds (WMMA forward, WMMA backward, FMA forward, FMA backward)
H200_OWN_MS = {
    (4, 4096, 32, 32, 128): (67.0, 132.1, 49.4, 149.0),
    (4, 4096, 32, 8, 128): (57.8, 125.6, 48.5, 152.2),
    (4, 4096, 32, 8, 64): (24.8, 54.1, 25.9, 88.9),
    (4, 2048, 40, 40, 128): (22.5, 44.5, 16.4, 48.4),
    (8, 1024, 16, 16, 64): (2.07, 4.41, 2.02, 6.23),
}
COLUMNS = (("wmma", "forward"), ("wmma", "backward"), ("fma", "forward"), ("fma", "backward"))
REFERENCE = {128: (4, 4096, 32, 32, 128), 64: (8, 1024, 16, 16, 64)}  # the shapes the profiles' rates are taken at


def _seconds(machine, variant, shape, direction):
    B, T, H, _, Dh = shape
    return attention_rates.attention_seconds(machine, "own", variant, B, H, T, Dh, direction)


@pytest.mark.parametrize("name", ["h200", "h100-sxm"])
def test_own_rates_are_the_h200_table_converted_by_the_causal_count(name):
    machine = load_machine(name)
    for Dh, shape in REFERENCE.items():
        for (variant, direction), ms in zip(COLUMNS, H200_OWN_MS[shape]):
            rate, source = attention_rate(machine, "own", variant, Dh, direction)
            B, T, H, _, _ = shape
            assert rate == pytest.approx(causal_flops(B, H, T, Dh, direction) / (ms / 1e3), rel=1e-4)
            assert "bench/log/attention.md" in source and "H200" in source


def test_own_rate_at_one_shape_predicts_every_measured_shape_within_25_percent():
    """Each variant and direction, from its rate at B4 T4096 H32 Hkv32 D128 (and at the 350M step's
    shape for head dim 64), predicts the other shapes of the H200 table within 25%."""
    machine = load_machine("h200")
    worst = 0.0
    for shape, times in H200_OWN_MS.items():
        for (variant, direction), ms in zip(COLUMNS, times):
            error = _seconds(machine, variant, shape, direction) * 1e3 / ms - 1
            worst = max(worst, abs(error))
            assert abs(error) <= 0.25, (shape, variant, direction, error)
    assert worst > 0.05  # the shapes differ: the check is not comparing each shape with itself


def test_sequence_model_is_what_makes_the_prediction_hold(monkeypatch):
    """Mutation: without the per-tile overhead (rate independent of T beyond the diagonal) a shape misses 25%."""
    monkeypatch.setattr(attention_rates, "TILE_OVERHEAD", 0)
    machine = load_machine("h200")
    errors = [abs(_seconds(machine, v, shape, d) * 1e3 / ms - 1)
              for shape, times in H200_OWN_MS.items() for (v, d), ms in zip(COLUMNS, times)]
    assert max(errors) > 0.25
    assert tile_efficiency(4096) > tile_efficiency(1024)


def _gpu_step_cfg(n_layers=24, d_model=1024, heads=16, seq=1024, batch=8, rank=256):
    model_keys = dict(arch="cola", vocab_size=32000, d_model=d_model, n_layers=n_layers, n_heads=heads, rank=rank,
                      seq_len=seq)
    return config_from_dict({"model": model_keys, "train": {"device": "gpu", "dtype": "bfloat16",
                                                            "micro_batch_size": batch}})


def _predict(cfg, machine, backend):
    w = model.workload_of(cfg)
    w = replace(w, shape=replace(w.shape, attention_backend=backend))
    return model.predict_workload(w, load_machine(machine), model.comm_bytes(cfg))


@pytest.mark.parametrize("machine", ["h200", "h100-sxm"])
def test_the_350m_gpu_step_with_own_attention_is_what_the_h200_ran(machine):
    """bench/gpu_step.py on the H200 (d1024, 24 layers, T 1024, B 8, 16 heads of 64, bf16): attention
    156 of 189 ms on the WMMA kernels."""
    p = _predict(_gpu_step_cfg(), machine, "own")
    assert p.breakdown["attention"] == pytest.approx(0.156, rel=0.05)
    assert p.time_s == pytest.approx(0.189, rel=0.15)
    assert p.breakdown["attention"] / p.time_s == pytest.approx(156 / 189, abs=0.05)
    assert _predict(_gpu_step_cfg(), machine, "cudnn").breakdown["attention"] < p.breakdown["attention"] / 10


def test_a_7b_wide_step_with_own_on_h100_sxm_is_the_h200s():
    """Two layers of the 7B (d 4096, 32 heads of 128, T 4096, B 4): each layer's attention is the
    H200's 67.0 + 132.1 ms (WMMA), and a recompute adds one forward."""
    cfg = _gpu_step_cfg(n_layers=2, d_model=4096, heads=32, seq=4096, batch=4, rank=1024)
    p = _predict(cfg, "h100-sxm", "own")
    assert p.breakdown["attention"] == pytest.approx(2 * (0.0670 + 0.1321), rel=1e-3)
    again = _predict(replace(cfg, train=replace(cfg.train, recompute="selective")), "h100-sxm", "own")
    assert again.breakdown["attention"] == pytest.approx(2 * (2 * 0.0670 + 0.1321), rel=1e-3)


@pytest.mark.parametrize("name", builtin_names())
def test_every_gpu_profile_rates_what_auto_runs_there_with_a_source(name):
    machine = load_machine(name)
    if machine.device != "gpu":
        return
    assert machine.attention_rates and all(t.source.strip() for t in machine.attention_rates.values())
    auto = attention_rates.resolve_backend("auto", machine)
    assert auto == ("cudnn" if machine.vendor == "nvidia" else "torch") and auto in machine.attention_rates
    if name in ("h200", "h100-sxm"):
        assert set(machine.attention_rates) == {"cudnn", "torch", "own"}


def _profile(tmp_path, old, new, name="h200"):
    text = (ROOT / "boostmpi" / "sim" / "profiles" / f"{name}.toml").read_text()
    assert old in text
    path = tmp_path / "bad.toml"
    path.write_text(text.replace(old, new, 1))
    return str(path)


@pytest.mark.parametrize("old, new, expected", [
    ("bfloat16 = 989e12", "bfloat16 = 0", "peak_flops.bfloat16 must be positive"),
    ("kernel_launch_s = 4e-6", "kernel_launch_s = -4e-6", "kernel_launch_s must be 0 or more"),
    ("elementwise_efficiency = 0.9", "elementwise_efficiency = 85", "elementwise_efficiency is a fraction"),
    ("gemm_efficiency = 0.85", "gemm_efficiency = 0", "gemm_efficiency is a fraction"),
    ("intra_node_latency = 5e-6", "intra_node_latency = -1.0", "intra_node_latency must be 0 or more"),
    ('source = "bench/log/attention.md: every attention backend', 'sauce = "bench/log/attention.md: every attention backend',
     "attention.cudnn has no source"),
    ("forward = 5.4551e14", "forward = 5.4551e17", "at most the profile's highest peak"),
    ("forward = 5.4551e14", "forward = -1.0", "attention.cudnn.d128.forward must be a rate"),
    ('vendor = "nvidia"', 'vendor = "amd"', "cuDNN runs on NVIDIA GPUs only"),
    ("wmma.d64", "tensor.d64", "unknown key 'tensor'"),
    ("shape = [4, 4096, 32, 32, 128] }\nd64", "shape = [4, 4096, 32, 32, 64] }\nd64", "has head dim 64, not 128"),
])
def test_a_profile_out_of_range_is_one_line_exit_2(tmp_path, capsys, old, new, expected):
    path = _profile(tmp_path, old, new)
    assert main(["sim", "--config", str(TINY), "--machine", path]) == 2
    err = capsys.readouterr().err.strip()
    assert expected in err and "\n" not in err and "Traceback" not in err


def test_a_backend_without_a_rate_is_one_line_exit_2(tmp_path, capsys):
    text = (ROOT / "boostmpi" / "sim" / "profiles" / "a100-80gb.toml").read_text()
    path = tmp_path / "no-cudnn.toml"
    path.write_text(text[:text.index("[attention.cudnn]")])
    cfg = ["--set", "train.device=gpu", "--set", "train.dtype=bfloat16"]
    assert main(["sim", "--config", str(TINY), "--machine", str(path)] + cfg) == 2
    err = capsys.readouterr().err.strip()
    assert "no rate for attention backend 'cudnn'" in err and "torch" in err and "\n" not in err
    with pytest.raises(Exception, match="no rate for attention backend 'own'"):
        attention_rate(load_machine("mi250x-gcd"), "own", "fma", 128, "forward")


def test_train_deterministic_false_prices_the_libraries_other_backward(tmp_path, capsys):
    """train.deterministic = false: cudnn's and torch's non-deterministic rates (faster backward; the
    h200 table measured both); a profile without them is one line naming the key, exit 2."""
    cfg = _gpu_step_cfg(n_layers=2, d_model=4096, heads=32, seq=4096, batch=4, rank=1024)
    fast = replace(cfg, train=replace(cfg.train, deterministic=False))
    for backend in ("cudnn", "torch"):
        exact, quick = _predict(cfg, "h200", backend), _predict(fast, "h200", backend)
        assert quick.breakdown["attention"] < exact.breakdown["attention"]
        rate = load_machine("h200").attention_rates[backend].rates[("nondeterministic", 128)]
        flops = causal_flops(4, 32, 4096, 128, "forward") + causal_flops(4, 32, 4096, 128, "backward")
        per_call = causal_flops(4, 32, 4096, 128) / rate.forward + causal_flops(4, 32, 4096, 128, "backward") / rate.backward
        assert quick.breakdown["attention"] == pytest.approx(2 * per_call, rel=1e-9) and flops > 0
    text = (ROOT / "boostmpi" / "sim" / "profiles" / "a100-80gb.toml").read_text()
    path = tmp_path / "a100.toml"
    path.write_text(text)
    args = ["--set", "train.device=gpu", "--set", "train.dtype=bfloat16", "--set", "train.deterministic=false"]
    assert main(["sim", "--config", str(TINY), "--machine", str(path)] + args) == 2
    err = capsys.readouterr().err.strip()
    assert "non-deterministic backward" in err and "train.deterministic = true" in err and "\n" not in err
    toml = "\n".join(attention_rates.tables_to_toml(load_machine("h200").attention_rates, repr))
    assert "nondeterministic.d128 = { forward = 608830000000000.0" in toml


def test_sim_breakdown_has_attention_and_plot_needs_a_known_format(tmp_path, capsys):
    assert main(["sim", "--config", str(TINY), "--machine", "h200", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert p["breakdown"]["attention"] > 0 and sum(p["breakdown"].values()) == pytest.approx(p["time_s"])
    assert main(["sim", "--config", str(TINY), "--machine", "h200", "--plot", str(tmp_path / "out.weird")]) == 2
    err = capsys.readouterr().err.strip()
    assert "--plot" in err and ".png" in err and "\n" not in err and not (tmp_path / "out.weird").exists()


def test_sim_cost_does_not_grow_with_n_layers(monkeypatch):
    """A billion layers: the parameter counts come from one layer per model chunk (closed forms); a
    walk over the layers (a mutant) would reach param_specs with the whole model."""
    walked = []
    real = model.param_specs

    def guarded(cfg, *args):
        walked.append(cfg.model.n_layers)
        assert cfg.model.n_layers <= 64, "walked the layers"
        return real(cfg, *args)

    monkeypatch.setattr(model, "param_specs", guarded)
    cfg = config_from_dict({"model": {"arch": "cola", "vocab_size": 256, "d_model": 32, "n_layers": 10**9,
                                      "n_heads": 4, "n_kv_heads": 2, "rank": 8, "d_ff": 64, "seq_len": 16},
                            "parallel": {"pp": 4, "virtual_stages": 2}, "train": {"grad_accum": 8}})
    p = model.predict(cfg, load_machine("h200"))
    assert walked and p.time_s > 0 and not p.memory_bytes["fits"]


def test_sim_imports_no_cupy_torch_or_cudnn():
    code = ("import sys\nfrom boostmpi.cli import main\n"
            f"assert main(['sim', '--config', {str(TINY)!r}, '--machine', 'h200', '--json']) == 0\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('cupy', 'cupy_backends', 'torch', 'cudnn')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_memory_estimate_does_not_depend_on_the_attention_backend():
    """The start-up memory check reads the model's bytes off a built-in profile that may not rate the
    configured backend (own on an A100): the estimate is made all the same."""
    cfg = _gpu_step_cfg(n_layers=2)
    w = model.workload_of(cfg)
    with pytest.raises(Exception, match="no rate for attention backend 'own'"):
        model.predict_workload(replace(w, shape=replace(w.shape, attention_backend="own")),
                               load_machine(builtin_names()[0]))
    original = model.workload_of

    def own(c):
        got = original(c)
        return replace(got, shape=replace(got.shape, attention_backend="own"))

    import unittest.mock

    with unittest.mock.patch.object(model, "workload_of", own):
        assert model.memory_estimate(cfg)["total"] == model.memory_estimate(cfg)["total"] > 0


def test_a_traced_attention_launch_is_priced_at_its_backends_rate():
    from boostmpi.sim.trace import TracedOp, op_seconds

    machine = load_machine("h200")
    flops = causal_flops(4, 32, 4096, 128, "backward")
    op = TracedOp(kind="attention", name="attention_backward_tc_bf16", site="model.layers.attention_backward",
                  nbytes=1, dtype="bfloat16", flops=flops)
    assert op_seconds(op, machine, 1) == pytest.approx(0.1321, rel=1e-3)  # the WMMA backward's 132.1 ms
    fma = replace(op, dtype="float32", name="attention_forward_hd64_f32", flops=causal_flops(8, 16, 1024, 64))
    assert op_seconds(fma, machine, 1) == pytest.approx(0.00202, rel=1e-3)  # FMA forward at d64: 2.02 ms
