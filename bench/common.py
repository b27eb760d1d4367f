"""What every benchmark shares: one BLAS/OpenMP thread, the machine description, interleaved
timing (warm-up rounds, then the median of timed rounds), a cProfile summary, MPI self-launch,
and the result block (appended to bench/log/<benchmark>.md).

Import this module before numpy: OpenBLAS reads its thread count once, when it is loaded.

The result block is markdown; its tables read as plain text too, so what a script prints and
what it appends to its log (`--append bench/log/<benchmark>.md`) are the same text.
"""

import os
import sys

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"
if "numpy" in sys.modules:
    raise RuntimeError("import bench/common.py before numpy: BLAS reads its thread count when it loads")

import argparse  # noqa: E402
import cProfile  # noqa: E402
import ctypes  # noqa: E402
import datetime  # noqa: E402
import platform  # noqa: E402
import pstats  # noqa: E402
import re  # noqa: E402
import shlex  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# set by a script that relaunches itself under mpiexec: the command the user typed, for the record
_COMMAND_ENV = "BOOSTMPI_BENCH_COMMAND"
_WORKER_ENV = "BOOSTMPI_BENCH_WORKER"


# ---------------------------------------------------------------- command line

def parser(description, warmup, repeats):
    """An ArgumentParser with the options every benchmark has."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--warmup", type=int, default=warmup, help="untimed rounds first (default %(default)s)")
    p.add_argument("--repeats", type=int, default=repeats, help="timed rounds; the median is reported (default %(default)s)")
    p.add_argument("--append", metavar="FILE", help="also append the result block to FILE (bench/log/<benchmark>.md)")
    return p


def command_line():
    """The command that started this benchmark, as typed from the repository root."""
    if os.environ.get(_COMMAND_ENV):
        return os.environ[_COMMAND_ENV]
    python = os.path.relpath(sys.executable) if sys.executable.startswith(os.getcwd()) else sys.executable
    # the OpenBLAS kernel choice changes every NumPy time, so the command states it either way
    core = os.environ.get("OPENBLAS_CORETYPE")
    prefix = f"OPENBLAS_CORETYPE={shlex.quote(core)}" if core else "env -u OPENBLAS_CORETYPE"
    return " ".join([prefix, "PYTHONPATH=.", shlex.quote(python)] + [shlex.quote(a) for a in sys.argv])


# ---------------------------------------------------------------- the machine

def _cpu_model():
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _openblas_library():
    """The OpenBLAS shared library numpy loaded (found in this process's memory map), or None."""
    try:
        with open("/proc/self/maps") as fh:
            paths = {line.split()[-1] for line in fh if "openblas" in line.lower() and "/" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


def _openblas_call(lib, name, restype):
    """Call OpenBLAS's `name` under whichever symbol prefix/suffix this build exports."""
    for prefix in ("scipy_openblas_", "openblas_"):
        for suffix in ("64_", ""):
            fn = getattr(lib, prefix + name + suffix, None)
            if fn is not None:
                fn.restype = restype
                return fn()
    return None


def blas_description():
    """numpy's BLAS as it runs here: library, kernel set chosen at run time, thread count."""
    try:
        build = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        name = f"{build.get('name')} {build.get('version')}"
    except Exception:  # noqa: BLE001 - older numpy: no dict form
        name = "unknown"
    lib = _openblas_library()
    if lib is None:
        return name
    core = _openblas_call(lib, "get_corename", ctypes.c_char_p)
    threads = _openblas_call(lib, "get_num_threads", ctypes.c_int)
    core = core.decode() if core else "?"
    return f"{name}, kernels {core}, {threads} thread(s)"


def machine_description(torch=None, mpi=False):
    """Lines naming the machine and the software versions that the numbers depend on."""
    cores = os.cpu_count()
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cores
    blas_env = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items())
                        if k.startswith(("OPENBLAS_", "OMP_", "MKL_")))
    lines = [
        f"CPU: {_cpu_model()}, {cores} logical cores ({usable} usable by this process)",
        f"Python {platform.python_version()}, numpy {np.__version__}, BLAS: {blas_description()}",
        f"environment: {blas_env}",
    ]
    if torch is not None:
        lines.append(f"torch {torch.__version__} (BLAS {torch_blas(torch)}), torch threads {torch.get_num_threads()}")
    if mpi:
        import mpi4py
        from mpi4py import MPI

        library = MPI.Get_library_version().strip().splitlines()[0].strip()
        lines.append(f"mpi4py {mpi4py.__version__}, {library}")
    lines.append(f"code: {code_version()}")
    lines.append("load average (1, 5, 15 min) at start: " + ", ".join(f"{x:.2f}" for x in os.getloadavg()))
    return lines


def code_version():
    """The commit measured, and whether the working tree had uncommitted changes (read-only git)."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30).stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        # the results files change with every appended block: not a change to what is measured
        dirty = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)bench/RESULTS.md",
                    ":(exclude)bench/log")
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git)"
    return f"commit {commit or 'unknown'}" + (" + uncommitted changes" if dirty else "")


def torch_blas(torch):
    found = re.search(r"BLAS_INFO=([^,\s]+)", torch.__config__.show())
    return found.group(1) if found else "unknown"


def torch_single_thread():
    """torch, limited to one intra-op and one inter-op thread (the benchmark rule)."""
    import torch

    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set, or parallel work already started
        pass
    return torch


# ---------------------------------------------------------------- timing

class Timings:
    """Seconds of each timed call per case: `wall` (elapsed) and `cpu` (this process's CPU time).

    On a machine shared with other work, wall time grows when the process is descheduled while
    CPU time does not; a wall time well above the CPU time of a single-threaded case says that
    the machine was busy during the measurement.
    """

    def __init__(self, names):
        self.wall = {name: [] for name in names}
        self.cpu = {name: [] for name in names}

    def median(self, name, clock="wall"):
        return statistics.median(getattr(self, clock)[name])

    def paired_ratio(self, a, b, clock="wall"):
        """Median over rounds of time(a) / time(b) within the same round (robust to slow drifts)."""
        pairs = zip(getattr(self, clock)[a], getattr(self, clock)[b])
        return statistics.median(x / y for x, y in pairs)


def time_interleaved(cases, warmup, repeats, barrier=None, reduce=None):
    """{name: callable} -> Timings of `repeats` timed calls of each case.

    Every round calls each case once, starting one case later each round, so a change in the
    load of this shared machine falls on every case alike instead of on whichever ran last.
    The first `warmup` rounds are not recorded. Under MPI, `barrier()` lines the ranks up before
    each call and `reduce(seconds)` turns a rank's time into the recorded one (the slowest rank).
    """
    names = list(cases)
    timings = Timings(names)
    for round_no in range(warmup + repeats):
        shift = round_no % len(names)
        for name in names[shift:] + names[:shift]:
            if barrier is not None:
                barrier()
            wall0, cpu0 = time.perf_counter(), time.process_time()
            cases[name]()
            wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
            if reduce is not None:
                wall, cpu = reduce(wall), reduce(cpu)
            if round_no >= warmup:
                timings.wall[name].append(wall)
                timings.cpu[name].append(cpu)
    return timings


def median(values):
    return statistics.median(values)


TIMING_HEADER = ["step ms (median)", "min-max ms", "CPU ms (median)"]


def timing_cells(timings, name):
    """The TIMING_HEADER cells of one case: wall median, wall min-max (how noisy), CPU median."""
    wall = timings.wall[name]
    return [f"{1e3 * median(wall):.0f}", f"{1e3 * min(wall):.0f}-{1e3 * max(wall):.0f}",
            f"{1e3 * timings.median(name, 'cpu'):.0f}"]


def profile(fn, steps):
    """Run `fn` `steps` times under cProfile; returns pstats.Stats.

    The profiler's clock is this process's CPU time, so the time the process spends waiting for a
    core on a busy machine does not land on whichever function happened to be running."""
    prof = cProfile.Profile(time.process_time)
    prof.enable()
    for _ in range(steps):
        fn()
    prof.disable()
    return pstats.Stats(prof)


def profile_cumulative(stats, function_name, file_suffix):
    """Cumulative seconds of one function (by name and file) in a profile, or None if absent."""
    for (path, _line, name), (_cc, _nc, _tt, ct, _callers) in stats.stats.items():
        if name == function_name and path.endswith(file_suffix):
            return ct
    return None


def profile_hot_spots(stats, steps, top):
    """A table of the `top` functions by own time (matrix products count in the function that
    writes the `@`), per step."""
    total = max(stats.total_tt, 1e-12)
    rows = []
    entries = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    for (path, line, name), (_cc, ncalls, tottime, cumtime, _callers) in entries:
        where = name if path == "~" else f"{_short_path(path)}:{line} {name}"
        rows.append([f"`{where}`", f"{ncalls / steps:.0f}", f"{1e3 * tottime / steps:.1f}",
                     f"{1e3 * cumtime / steps:.1f}", f"{100 * tottime / total:.1f}%"])
    return markdown_table(["function", "calls/step", "own CPU ms/step", "cumulative CPU ms/step", "own share"], rows)


# the phases of an engine step, found in a profile by function name and file
STEP_PHASES = (("forward (embedding, blocks, head + loss)", "_stage_forward", "parallel/engine.py"),
               ("backward (head, blocks, embedding)", "_stage_backward", "parallel/engine.py"),
               ("optimizer (AdamW)", "step", "train/optim.py"))


def step_profile_section(title, step, steps, top):
    """Markdown: `step()` profiled `steps` times with cProfile, as phases and hot spots."""
    stats = profile(step, steps)
    rows = []
    for label, function_name, path in STEP_PHASES:
        seconds = profile_cumulative(stats, function_name, path)
        rows.append([label, "n/a" if seconds is None else f"{1e3 * seconds / steps:.0f}",
                     "" if seconds is None else f"{100 * seconds / stats.total_tt:.0f}%"])
    rows.append(["whole step under the profiler", f"{1e3 * stats.total_tt / steps:.0f}", "100%"])
    return (f"### {title} (cProfile, process CPU time, {steps} steps)\n\n"
            + markdown_table(["phase", "CPU ms/step", "share"], rows)
            + f"\n\nTop {top} functions by own time (a matrix product counts in the function that writes it):\n\n"
            + profile_hot_spots(stats, steps, top))


def _short_path(path):
    try:
        return os.path.relpath(path, REPO) if path.startswith(str(REPO)) else Path(path).name
    except ValueError:
        return path


# ---------------------------------------------------------------- boostmpi pieces

LR = 1e-3  # constant: the learning-rate schedule is not what is measured


def build_engine(model, batch, parallel=None, train=None, world=None):
    """(cfg, engine, AdamW optimizer, step function) for one micro-batch of `batch` sequences.

    The step function runs one training step, forward + backward + AdamW update, on the batch it
    is given and returns the loss."""
    from boostmpi.config import config_from_dict
    from boostmpi.parallel.engine import Engine
    from boostmpi.train.optim import AdamW

    sections = {"model": model, "parallel": parallel or {},
                "train": {"micro_batch_size": batch, "dtype": "float32", **(train or {})}}
    cfg = config_from_dict(sections, world_size=1 if world is None else world.Get_size())
    engine = Engine(cfg, world)
    opt = AdamW(engine.params, engine.specs, cfg.train)

    def step(x, y):
        loss = engine.forward_backward([(x, y)])
        opt.step(engine.grads, LR)
        return loss

    return cfg, engine, opt, step


def step_tracking_tp_wait(engine, step, x, y):
    """(run, waits): `run()` takes one step on (x, y) and appends to `waits` the seconds this rank
    spent blocked in tensor-parallel collectives during it."""
    waits = []

    def run():
        before = engine.grid.tp.wait_seconds
        step(x, y)
        waits.append(engine.grid.tp.wait_seconds - before)

    return run, waits


def random_batch(model, batch, seed=0):
    """Token ids x, y [batch, seq_len], the same on every rank for the same seed."""
    rng = np.random.default_rng(seed)
    shape = (batch, model["seq_len"])
    return rng.integers(0, model["vocab_size"], size=shape), rng.integers(0, model["vocab_size"], size=shape)


# ---------------------------------------------------------------- MPI

def mpi_worker():
    """True inside a benchmark's own mpiexec launch."""
    return os.environ.get(_WORKER_ENV) == "1"


def launch_under_mpiexec(ranks, timeout_s, extra_args=(), record_command=True):
    """Run this script again as `timeout T mpiexec -n ranks python script args`; returns its exit status.

    The mpiexec is the one `boostmpi.parallel.launch.find_mpiexec` picks for this Python.
    """
    from boostmpi.parallel.launch import find_mpiexec

    mpiexec = find_mpiexec()
    env = dict(os.environ, **{_WORKER_ENV: "1"})
    if record_command:
        env[_COMMAND_ENV] = command_line()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    cmd = ["timeout", str(timeout_s), mpiexec, "-n", str(ranks), sys.executable, sys.argv[0],
           *sys.argv[1:], *extra_args]
    return subprocess.call(cmd, env=env)


def mpi_timing_hooks(world):
    """(barrier, reduce) for time_interleaved: line the ranks up; record the slowest rank's time."""
    from mpi4py import MPI

    return world.Barrier, (lambda seconds: world.allreduce(seconds, op=MPI.MAX))


# ---------------------------------------------------------------- the result block

def markdown_table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def verdict(met):
    return "**met**" if met else "**NOT met**"


def emit(title, machine_lines, sections, append_to=None):
    """Print the result block (and append it to `append_to`): title, date, command, machine, then
    each section (markdown text) in order."""
    block = [f"## {title}", "",
             f"- date: {datetime.datetime.now().astimezone().strftime('%Y-%m-%d %H:%M %Z')}",
             f"- command: `{command_line()}`"]
    block += [f"- {line}" for line in machine_lines]
    block.append("- load average (1, 5, 15 min) at end: " + ", ".join(f"{x:.2f}" for x in os.getloadavg()))
    text = "\n".join(block) + "\n\n" + "\n\n".join(s.strip() for s in sections) + "\n"
    print(text, flush=True)
    if append_to:
        with open(append_to, "a") as fh:
            fh.write("\n" + text)
    return text
