"""bench/gpu_calibrate.py without a GPU: its shape list, its arithmetic through --timings, its refusal.

The raw timings here are made from a known profile (GEMM seconds from `boostmpi.sim.costs.gemm_seconds`
with a chosen k-overhead), so the fit must find that overhead again with residuals of ~0, and every
other rate must come out of the stated arithmetic; the profile it writes must load through
`boostmpi.sim.machines` and carry a source for every key and one `[attention.<backend>]` table per
backend that ran.
"""

import importlib.util
import json
import math
import subprocess
import sys
import tomllib
from dataclasses import replace
from pathlib import Path

import pytest

from tests.support import gpu_compilers
from boostmpi.sim.costs import gemm_seconds
from boostmpi.sim.machines import _LAYOUT, load_machine, machine_from_file
from tests.support.gpu_setup import GPU

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "bench" / "gpu_calibrate.py"


def load_script(path):
    """A bench script as a module (bench is not a package)."""
    spec = importlib.util.spec_from_file_location(f"{Path(path).stem}_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def calibrate():
    return load_script(SCRIPT)


def test_gemm_shapes_are_the_planned_layers_each_once(calibrate):
    shapes = calibrate.gemm_shapes()
    keys = [s[:4] for s in shapes]
    assert len(keys) == len(set(keys)) == 162 <= calibrate.MAX_GEMM_SHAPES
    labels = " | ".join(s[4] for s in shapes)
    for layout in ("7b", "13b"):
        for arch in ("cola", "full"):
            for tp in (1, 2, 4, 8):
                assert f"{layout} {arch} tp{tp} " in labels or arch == "full"  # full repeats cola's dx/dw shapes less
    N = 4 * 4096
    assert (N, 1024, 1024, 1) in keys  # 7B cola tp 4: q.B forward (r 1024 -> d 4096 / 4)
    assert (N, 12288, 4096, 1) in keys  # 7B full tp 1: the fused q, k, v projection
    assert (1280, 13824 // 8, N, 1) in keys  # 13B cola tp 8: gate.B's weight gradient
    assert (N, 1280, 5120 // 8, 1) in keys  # 13B cola tp 8: o.A forward


TRUTH_K0 = 128.0
PAPER = [(4, 4096, 32, 32, 64), (4, 4096, 12, 12, 128), (4, 4096, 8, 8, 128), (4, 4096, 10, 10, 128)]


def _raw(calibrate, base):
    truth = replace(base, peak_flops={"bfloat16": 800e12, "float32": 50e12}, gemm_efficiency=1.0,
                    gemm_k_overhead=TRUTH_K0, gemm_mn_overhead=0.0, kernel_launch_s=2.5e-6, compute_units=132,
                    memory_bandwidth=4.0e12, elementwise_efficiency=0.8)  # as the launch and copy rows below say
    gemm = [[m, n, k, b, gemm_seconds(m, n, k, b, 2, truth, "bfloat16"), label]
            for m, n, k, b, label in calibrate.gemm_shapes()]
    rows = []
    for B, T, H, Hkv, Dh in PAPER:
        flops = 2.0 * B * H * T * T * Dh  # the causal forward count
        for backend, fwd_rate, bwd_rate in (("sdpa", 500e12, 400e12), ("cudnn", 520e12, 410e12),
                                            ("torch", 480e12, 380e12), ("own-wmma", 300e12, 150e12),
                                            ("own-fma", 60e12, 30e12)):
            row = {"backend": backend, "B": B, "T": T, "H": H, "Hkv": Hkv, "Dh": Dh,
                   "fwd_s": flops / fwd_rate, "bwd_s": 2.5 * flops / bwd_rate, "error": None}
            if backend == "torch" and Dh == 64:
                row.update(fwd_s=None, bwd_s=None, error="RuntimeError: no kernel for this shape")
            rows.append(row)
    return {"device": {"name": "NVIDIA H200", "sm_count": 132, "memory_bytes": 150_000_000_000, "gpus": 1,
                       "driver": 13000, "runtime": 13000, "cupy": "14.2.0", "cudnn": "91400", "torch": "2.11.0",
                       "host": "gpu-node"},
            "date": "2026-11-28 04:00 UTC", "raw_path": "bench/log/calibrate-h200.json",
            "gemm": gemm, "peak": {"bfloat16": [8192, 2 * 8192 ** 3 / 750e12], "float32": [8192, 2 * 8192 ** 3 / 50e12]},
            "copy": {"bytes": 2 << 30, "seconds": (2 << 30) / 4.0e12},
            "fused": {"rmsnorm_forward": 3.0e12, "rmsnorm_backward": 3.4e12, "copy_same_bytes": 4.0e12},
            "adamw": {"params": 1 << 26, "seconds": 8 * (1 << 26) * 4 / 3.2e12},
            "launch": {"launches": 10_000, "seconds": 0.025},
            "attention": rows}


def test_timings_give_the_profile_by_the_stated_arithmetic(calibrate, tmp_path, capsys):
    base = load_machine("h100-sxm")
    raw_file = tmp_path / "raw.json"
    raw_file.write_text(json.dumps(_raw(calibrate, base)))
    out = tmp_path / "h200.toml"
    assert calibrate.main(["--timings", str(raw_file), "--out", str(out), "--base", "h100-sxm"]) == 0
    printed = capsys.readouterr().out
    assert "7b cola tp4 q.B fwd" in printed and "rms residual 0.00" in printed and "over 162 shapes" in printed

    m = machine_from_file(out)
    assert m.gemm_k_overhead == TRUTH_K0 and m.gemm_mn_overhead == 0.0
    # the best planned shape's rate, or the fit's overhead-free rate when that is higher (an efficiency is at most 1)
    best = max(2 * g[0] * g[1] * g[2] * g[3] / g[4] for g in _raw(calibrate, base)["gemm"])
    assert m.peak_flops["bfloat16"] >= best * (1 - 1e-5) and 0 < m.gemm_efficiency <= 1
    assert m.peak_flops["bfloat16"] * m.gemm_efficiency == pytest.approx(800e12, rel=0.002)
    assert m.peak_flops["float32"] == pytest.approx(50e12)
    assert m.memory_bandwidth == pytest.approx(4.0e12) and m.elementwise_efficiency == pytest.approx(0.8)
    assert m.optimizer_passes == pytest.approx(8.0)
    assert m.kernel_launch_s == pytest.approx(2.5e-6)
    assert m.compute_units == 132 and m.gpus_per_node == 1 and m.memory_capacity_bytes == 150e9
    assert (m.gemm_tile_m, m.intra_node_bandwidth) == (base.gemm_tile_m, base.intra_node_bandwidth)
    # one rate table per backend that ran (own per variant), each at the largest shape measured
    rates = m.attention_rates
    assert set(rates) == {"cudnn", "torch", "own"}
    assert set(rates["own"].rates) == {("wmma", 64), ("wmma", 128), ("fma", 64), ("fma", 128)}
    cudnn = rates["cudnn"].rates[(None, 128)]
    assert (cudnn.forward, cudnn.backward) == (pytest.approx(520e12), pytest.approx(410e12)) and cudnn.shape[4] == 128
    assert rates["own"].rates[("wmma", 128)].backward == pytest.approx(150e12)
    assert all(str(raw_file) in table.source for table in rates.values())

    doc = tomllib.loads(out.read_text())
    assert set(doc["sources"]) | {"name", "description", "device", "attention"} == set(_LAYOUT)
    assert "measured by bench/gpu_calibrate.py on NVIDIA H200" in doc["sources"]["memory_bandwidth"]
    assert "from the h100-sxm profile" in doc["sources"]["intra_node_bandwidth"]
    assert "NVIDIA H200" in out.read_text().splitlines()[0] and "driver 13000" in out.read_text()


def test_the_fit_sees_a_wrong_overhead(calibrate):
    """The residuals are the model's against the measurement: times made with another overhead show."""
    base = load_machine("h100-sxm")
    raw = _raw(calibrate, base)
    machine, _, residuals = calibrate.build_profile(raw, base, "x", "test")
    worse = calibrate.gemm_residuals(replace(machine, gemm_k_overhead=1024.0), raw["gemm"])
    assert max(abs(r[-1]) for r in residuals) < 0.01 < min(abs(r[-1]) for r in worse)
    assert math.isclose(residuals[0][5], 2.0 * 16384 * 3072 * 4096 / raw["gemm"][0][4])


@pytest.mark.skipif(not GPU.standin, reason="a real GPU is here: the script would measure it")
@pytest.mark.parametrize("cupy_kind", ["standin", "real"])
def test_without_a_gpu_it_refuses_in_one_line_and_writes_nothing(tmp_path, cupy_kind):
    import os

    env = dict(os.environ) if cupy_kind == "standin" else gpu_compilers._real_cupy_env()
    out = tmp_path / "profile.toml"
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: bench/gpu_calibrate.py measures a GPU"), lines
    assert ("stand-in" in lines[0]) == (cupy_kind == "standin")
    assert list(tmp_path.iterdir()) == []


def test_bad_timings_file_is_one_line(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    done = subprocess.run([sys.executable, str(SCRIPT), "--timings", str(bad), "--out", str(tmp_path / "p.toml")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not (tmp_path / "p.toml").exists()


def test_a_run_where_no_attention_backend_ran_says_so(calibrate):
    """Every backend an error row: the profile keeps the base's attention rates and its source says why."""
    base = load_machine("h100-sxm")
    raw = _raw(calibrate, base)
    for row in raw["attention"]:
        row.update(fwd_s=None, bwd_s=None, error="BackendUnavailable: not here")
    machine, sources, _ = calibrate.build_profile(raw, base, "x", "test")
    assert machine.attention_rates == base.attention_rates
    assert sources["attention_rates"] == "not measured (no attention backend ran): from the h100-sxm profile"
