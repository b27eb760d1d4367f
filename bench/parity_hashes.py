"""Parity hashes: SHA-256 of what training computes and writes, over the layouts and archs the parity
tests cover, so that a change meant to leave every bit alone (a refactor) can be checked by running
this before and after and comparing the tables.

Per case (a layout, an arch, a dtype, some engine options) `boostmpi train` runs a few steps with a
checkpoint after every step, in-process on every MPI rank (one mpiexec per world size, every case of
that size in turn). Hashed, each as one SHA-256 over the case:

- losses: every row of metrics.jsonl (loss, lr, grad_norm, val_loss, tokens, ...), its timing fields
  (step_time_s, tokens_per_s) and counters aside;
- counters: metrics.jsonl's comm_bytes, comm_calls and memory (its process peak aside);
- grads: the gradient each rank hands to the optimizer, at every step (AdamW.step's `grads`, the
  dp-summed gradient of the rank's optimizer slice, before clipping), with the clip scale and the
  learning rate; in world-rank order;
- weights: model.h5's tensors (read through its virtual datasets) of every checkpoint;
- moments: optim.h5's `m/` and `v/` tensors of every checkpoint;
- rank_files: every dataset of every rank file (name, dtype, shape, values, attributes);
- attrs: every attribute of every HDF5 object of every checkpoint file, and the virtual datasets'
  mappings (source file, dataset, selection), run-directory paths replaced by a placeholder;
- state: state.json, paths replaced;
- marker: COMPLETE's file names, sizes, and the checksums of the files that hold no path (the rank
  files);
- files: the folder listing of the run directory's checkpoints (names only).

Nothing here imports the code under test except the workers, which import `boostmpi` from `--repo`
(default: this checkout): run it from any checkout, or point it at one, and compare the JSON tables.

    PYTHONPATH=. .venv/bin/python bench/parity_hashes.py --json out.json [--repo PATH] [--append bench/log/parity_hashes.md]

Takes about 3-5 minutes on the shared 2-core VM (up to 4 ranks oversubscribed).
"""

import argparse
import datetime
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.abspath(__file__)
DEFAULT_REPO = os.path.dirname(os.path.dirname(HERE))
WORK_PLACEHOLDER = "<WORK>"

MODEL = dict(arch="cola", vocab_size=256, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, rank=8, d_ff=64,
             seq_len=16)
GLOBAL_BATCH = 12  # sequences per step, divisible by every dp below
STEPS = 3
COMMON = dict(steps=STEPS, warmup_steps=1, lr=0.01, grad_clip=0.5, weight_decay=0.1, seed=21, val_every=STEPS,
              val_windows=2, log_every=1)

# name -> (world size, {"section.key": value}); every case checkpoints after each step
CASES = {}


def _case(name, tp=1, pp=1, dp=1, arch="cola", dtype="float64", grad_accum=None, **extra):
    per_replica = GLOBAL_BATCH // dp
    if grad_accum is None:  # under pp, enough micro-batches for 1F1B's steady state
        grad_accum = pp + 1 if per_replica % (pp + 1) == 0 else 1
    settings = {"model.arch": arch, "parallel.tp": tp, "parallel.pp": pp, "parallel.dp": dp,
                "train.dtype": dtype, "train.grad_accum": grad_accum,
                "train.micro_batch_size": per_replica // grad_accum, "checkpoint.every": 1}
    if arch == "full":
        settings["parallel.tp_mode"] = "vanilla"
    settings.update(extra)
    CASES[name] = (tp * pp * dp, settings)


# one rank: every arch in both dtypes, and an asynchronous save
for _arch in ("cola", "svd", "full"):
    for _dtype in ("float64", "float32"):
        _case(f"r1-{_arch}-{_dtype}", arch=_arch, dtype=_dtype)
_case("r1-cola-float64-async", **{"checkpoint.async": True})
# two ranks: each tp strategy, norms, groupings, recompute, pp (and interleaved), dp with and without
# ZeRO-1 and overlap, an asynchronous save
_case("tp2-btp-cola", tp=2)
_case("tp2-btp-svd-sync-ungrouped-lowrank", tp=2, arch="svd", **{"parallel.norm": "sync", "parallel.grouped": False,
                                                                   "train.recompute": "lowrank"})
_case("tp2-vanilla-cola-layer", tp=2, **{"parallel.tp_mode": "vanilla", "train.recompute": "layer"})
_case("tp2-full-float32", tp=2, arch="full", dtype="float32")
_case("pp2-svd", pp=2, arch="svd")
_case("pp2-v2-cola", pp=2, grad_accum=4, **{"parallel.virtual_stages": 2, "model.n_layers": 4})
_case("dp2-cola", dp=2)
_case("dp2-cola-no-overlap", dp=2, **{"parallel.overlap": False})
_case("dp2-zero1-full-float32", dp=2, arch="full", dtype="float32")
_case("dp2-zero1-cola-float32-async", dp=2, dtype="float32", **{"parallel.zero_stage": 1, "checkpoint.async": True})
# three ranks
_case("dp3-zero1-svd", dp=3, arch="svd", **{"parallel.zero_stage": 1})
_case("pp3-cola", pp=3, **{"model.n_layers": 3})
# four ranks
_case("tp2-pp2-cola", tp=2, pp=2)
_case("tp2-dp2-zero1-svd", tp=2, dp=2, arch="svd", **{"parallel.zero_stage": 1})
_case("pp2-dp2-zero1-full-float32", pp=2, dp=2, arch="full", dtype="float32", **{"parallel.zero_stage": 1})
_case("tp2-dp2-vanilla-cola", tp=2, dp=2, **{"parallel.tp_mode": "vanilla"})
_case("tp4-vanilla-cola", tp=4, **{"parallel.tp_mode": "vanilla"})

# fields of a metrics row that measure time or speed, or the process's memory high-water mark: not
# what was computed
TIMING_FIELDS = ("tokens_per_s", "step_time_s", "peak")
# fields that count what moved and what was held (communication, memory accounting), hashed apart from
# the losses so that a change of accounting alone shows as such
COUNTER_FIELDS = ("comm_bytes", "comm_calls", "memory")


# ---------------------------------------------------------------- the worker (under mpiexec)

def _toml_value(value):
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


def write_config(path):
    lines = ["[model]"] + [f"{k} = {_toml_value(v)}" for k, v in MODEL.items()]
    lines += ["", "[train]"] + [f"{k} = {_toml_value(v)}" for k, v in COMMON.items()]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def worker(work, names):
    """Every rank: `boostmpi train` for each case in turn, recording the gradients AdamW.step receives."""
    import numpy as np
    from mpi4py import MPI

    import boostmpi
    from boostmpi.cli import main
    from boostmpi.train import optim

    rank = MPI.COMM_WORLD.Get_rank()
    real_step = optim.AdamW.step
    seen = []

    def recording_step(self, grads, lr, grad_scale=1.0):
        lo, hi = self.shard
        g = grads.data[lo:hi] if hasattr(grads, "data") and not isinstance(grads, np.ndarray) else grads
        g = np.ascontiguousarray(np.asarray(g))
        seen.append(hashlib.sha256(f"{g.dtype.str}{g.shape}{float(lr)!r}{float(grad_scale)!r}".encode()
                                   + g.tobytes()).hexdigest())
        return real_step(self, grads, lr, grad_scale)

    optim.AdamW.step = recording_step
    if rank == 0:
        print(f"boostmpi from {os.path.dirname(boostmpi.__file__)}", flush=True)
    for name in names:
        settings = CASES[name][1]
        run_dir = os.path.join(work, "runs", name)
        argv = ["train", "--config", os.path.join(work, "parity.toml"),
                "--set", f"train.run_dir={run_dir}",
                "--set", f"data.train={os.path.join(work, 'data', 'train.bin')}",
                "--set", f"data.val={os.path.join(work, 'data', 'val.bin')}"]
        for key, value in settings.items():
            argv += ["--set", f"{key}={_toml_value(value) if isinstance(value, bool) else value}"]
        seen.clear()
        status = main(argv)
        statuses = MPI.COMM_WORLD.allgather(status)
        grads = MPI.COMM_WORLD.gather(list(seen), root=0)
        if rank == 0:
            with open(os.path.join(work, "grads", name + ".json"), "w") as f:
                json.dump({"status": statuses, "grads": grads}, f)
            print(f"{name}: exit {statuses}", flush=True)
        if any(statuses):
            return 1
    return 0


# ---------------------------------------------------------------- hashing (no boostmpi import)

def _normalize(value, work):
    """A JSON-able, path-free form of an attribute or state value."""
    import numpy as np

    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    if isinstance(value, str):
        return value.replace(work, WORK_PLACEHOLDER)
    if isinstance(value, np.ndarray):
        return {"dtype": value.dtype.str, "shape": list(value.shape),
                "sha256": hashlib.sha256(np.ascontiguousarray(value).tobytes()).hexdigest()}
    if isinstance(value, np.generic):
        return {"dtype": value.dtype.str, "value": repr(value.item())}
    if isinstance(value, dict):
        return {k: _normalize(v, work) for k, v in sorted(value.items())}
    if isinstance(value, (list, tuple)):
        return [_normalize(v, work) for v in value]
    return value


def _attrs(obj, work):
    return {k: _normalize(obj.attrs[k], work) for k in sorted(obj.attrs.keys())}


def _h5_objects(path, work):
    """[(name, kind, attrs, dataset description or None, values bytes or None)] of every object of an
    HDF5 file, the root first, then in name order."""
    import h5py
    import numpy as np

    out = []
    with h5py.File(path, "r") as f:
        out.append(("/", "file", _attrs(f, work), None, None))
        names = []
        f.visit(names.append)
        for name in sorted(names):
            obj = f[name]
            if isinstance(obj, h5py.Dataset):
                values = np.ascontiguousarray(obj[()])
                desc = {"dtype": obj.dtype.str, "shape": list(obj.shape), "virtual": obj.is_virtual}
                if obj.is_virtual:
                    desc["sources"] = [[vs.file_name, vs.dset_name, _normalize(repr(vs.vspace.get_select_bounds()), work),
                                        _normalize(repr(vs.src_space.get_select_bounds()), work)]
                                       for vs in obj.virtual_sources()]
                out.append((name, "dataset", _attrs(obj, work), desc, values.tobytes()))
            else:
                out.append((name, "group", _attrs(obj, work), None, None))
    return out


class Hashes:
    def __init__(self, names):
        self.h = {n: hashlib.sha256() for n in names}

    def add(self, name, *parts):
        h = self.h[name]
        for part in parts:
            data = part if isinstance(part, bytes) else json.dumps(part, sort_keys=True).encode()
            h.update(len(data).to_bytes(8, "little"))
            h.update(data)

    def hexdigests(self):
        return {n: h.hexdigest() for n, h in self.h.items()}


def _drop_timing(row):
    if isinstance(row, dict):
        return {k: _drop_timing(v) for k, v in row.items() if k not in TIMING_FIELDS}
    return row


CATEGORIES = ("losses", "counters", "grads", "weights", "moments", "rank_files", "attrs", "state", "marker", "files")


def hash_case(work, name):
    run_dir = os.path.join(work, "runs", name)
    hashes = Hashes(CATEGORIES)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            if line.strip():
                row = _drop_timing(json.loads(line))
                hashes.add("losses", {k: _normalize(v, work) for k, v in row.items() if k not in COUNTER_FIELDS})
                hashes.add("counters", {k: v for k, v in row.items() if k in COUNTER_FIELDS})
    with open(os.path.join(work, "grads", name + ".json")) as f:
        hashes.add("grads", json.load(f)["grads"])
    root = os.path.join(run_dir, "checkpoints")
    listing = sorted(os.listdir(root))
    hashes.add("files", listing)
    for step_name in listing:
        folder = os.path.join(root, step_name)
        if not os.path.isdir(folder):
            with open(folder) as f:
                hashes.add("files", step_name, f.read())
            continue
        files = sorted(os.listdir(folder))
        hashes.add("files", step_name, files)
        for file_name in files:
            path = os.path.join(folder, file_name)
            if file_name.endswith(".h5"):
                for obj_name, kind, attrs, desc, values in _h5_objects(path, work):
                    hashes.add("attrs", step_name, file_name, obj_name, kind, attrs, desc)
                    if values is None:
                        continue
                    if file_name == "model.h5":
                        hashes.add("weights", step_name, obj_name, desc["dtype"], desc["shape"], values)
                    elif file_name == "optim.h5":
                        hashes.add("moments", step_name, obj_name, desc["dtype"], desc["shape"], values)
                    else:
                        hashes.add("rank_files", step_name, file_name, obj_name, attrs, desc, values)
            elif file_name == "state.json":
                with open(path) as f:
                    hashes.add("state", step_name, _normalize(json.load(f), work))
            elif file_name == "COMPLETE":
                with open(path) as f:
                    marker = json.load(f)
                for recorded, record in sorted(marker.items()):
                    # the global files hold the run's paths (the config attribute): their sizes only
                    kept = record if recorded.startswith("rank-") else {"bytes": record.get("bytes")}
                    hashes.add("marker", step_name, recorded, kept)
    return hashes.hexdigests()


# ---------------------------------------------------------------- the driver

def write_data(work, repo):
    """Two token shards of seeded random ids, written by the checkout's own shard writer."""
    code = ("import sys, numpy as np\n"
            "from boostmpi.data.shards import write_shard\n"
            "rng = np.random.default_rng(7)\n"
            "write_shard(sys.argv[1], rng.integers(0, 256, 60000).astype(np.uint16))\n"
            "write_shard(sys.argv[2], rng.integers(0, 256, 8000).astype(np.uint16))\n")
    os.makedirs(os.path.join(work, "data"))
    subprocess.run([sys.executable, "-c", code, os.path.join(work, "data", "train.bin"),
                    os.path.join(work, "data", "val.bin")], check=True, env=_env(repo))


def _env(repo):
    env = dict(os.environ, PYTHONPATH=repo, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return env


def _mpiexec():
    local = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return local if os.path.exists(local) else shutil.which("mpiexec") or "mpiexec"


def run_all(repo, work, names, timeout_s):
    by_size = {}
    for name in names:
        by_size.setdefault(CASES[name][0], []).append(name)
    for size, group in sorted(by_size.items()):
        cmd = ["timeout", str(timeout_s), _mpiexec(), "-n", str(size), sys.executable, HERE, "--worker",
               "--work", work, "--cases", ",".join(group)]
        t = time.time()
        proc = subprocess.run(cmd, env=_env(repo), cwd=work, capture_output=True, text=True)
        print(f"# {size} rank(s), {len(group)} case(s): exit {proc.returncode}, {time.time() - t:.0f} s", file=sys.stderr)
        if proc.returncode != 0:
            sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
            raise SystemExit(f"error: the {size}-rank worker failed (exit {proc.returncode})")
        for line in proc.stdout.splitlines():
            if line.startswith("boostmpi from"):
                print(f"# {line}", file=sys.stderr)


def git_commit(repo):
    try:
        head = subprocess.run(["git", "-C", repo, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", repo, "status", "--porcelain", "--", "boostmpi"],
                               capture_output=True, text=True, check=True).stdout.strip()
        return head + (" (with uncommitted changes under boostmpi/)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):  # not a git checkout (an exported tree)
        return f"{repo} (not a git checkout)"


def markdown(table, commit, command, seconds):
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"## parity hashes, {now}", "", f"- command: `{command}`", f"- code: {commit}",
             f"- {len(table)} cases, {seconds:.0f} s; each cell: the first 12 hex digits of the SHA-256", "",
             "| case | " + " | ".join(CATEGORIES) + " |", "|---|" + "---|" * len(CATEGORIES)]
    for name, row in table.items():
        lines.append(f"| {name} | " + " | ".join(row[c][:12] for c in CATEGORIES) + " |")
    everything = hashlib.sha256(json.dumps(table, sort_keys=True).encode()).hexdigest()
    lines += ["", f"all cases together: `{everything}`", ""]
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repo", default=DEFAULT_REPO, help="the checkout whose boostmpi is run (default: this one)")
    p.add_argument("--json", metavar="FILE", help="write {case: {category: sha256}} to FILE")
    p.add_argument("--append", metavar="FILE", help="append the markdown table to FILE")
    p.add_argument("--cases", help="comma-separated case names (default: all)")
    p.add_argument("--timeout", type=int, default=600, help="seconds per mpiexec launch")
    p.add_argument("--keep", action="store_true", help="keep the work folder (its path is printed)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    args = p.parse_args()
    names = args.cases.split(",") if args.cases else list(CASES)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        print(f"error: unknown case(s) {', '.join(unknown)}; known: {', '.join(CASES)}", file=sys.stderr)
        return 2
    if args.worker:
        return worker(args.work, names)
    repo = os.path.abspath(args.repo)
    work = os.path.realpath(tempfile.mkdtemp(prefix="parity-"))
    started = time.time()
    try:
        os.makedirs(os.path.join(work, "grads"))
        write_config(os.path.join(work, "parity.toml"))
        write_data(work, repo)
        run_all(repo, work, names, args.timeout)
        table = {name: hash_case(work, name) for name in names}
    finally:
        if args.keep:
            print(f"# work folder kept: {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    command = " ".join(shlex.quote(a) for a in [os.path.relpath(sys.executable)] + sys.argv)
    text = markdown(table, git_commit(repo), command, time.time() - started)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(table, f, indent=1, sort_keys=True)
    if args.append:
        with open(args.append, "a") as f:
            f.write("\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
