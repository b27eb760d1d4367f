"""The emulated srun of a Slurm site, strict: an option the site's pages do not show, a value out of
its set, more nodes than the job has, more tasks x CPUs or GPUs than a node holds, or a call outside
a job is an error (one line, status 1), as srun refuses. Otherwise it runs the ranks on this machine
(testing/site_emu/ranks.py) with the variables srun gives each task (SLURM_PROCID, SLURM_LOCALID,
SLURM_NODEID, SLURM_STEP_NUM_TASKS), its CPU binding (--cpu-bind=cores: one CPU of this machine per
task) and, for --gpus-per-task=1 --gpu-bind=closest, the GPU of the task's L3 region (OLCF Frontier
User Guide: NUMA 0 cores -> GPUs 4,5; NUMA 1 -> 2,3; NUMA 2 -> 6,7; NUMA 3 -> 0,1), and forwards
SIGUSR1/SIGTERM/SIGINT to them."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ranks  # noqa: E402

FRONTIER_CLOSEST = [4, 5, 2, 3, 6, 7, 0, 1]


def fail(message):
    print(f"srun: error: {message}", file=sys.stderr)
    sys.exit(1)


def parse(argv, allowed, values):
    opts, i = {}, 0
    while i < len(argv):
        a = argv[i]
        if not a.startswith("-"):
            return opts, argv[i:]
        name, eq, value = a.partition("=")
        if name not in allowed:
            fail(f"unrecognized option '{name}' (the site's pages show: {' '.join(sorted(allowed))})")
        if not eq:
            if name in ("-u",):
                value = ""
            else:
                i += 1
                if i >= len(argv):
                    fail(f"option '{name}' requires an argument")
                value = argv[i]
        if name in values and value not in values[name]:
            fail(f"invalid {name} value '{value}' (expected one of {', '.join(sorted(values[name]))})")
        opts[name] = value
        i += 1
    fail("no program to run")


def main(argv):
    root = os.environ["EMU_ROOT"]
    with open(os.path.join(root, "emu", "site.json")) as f:
        site = json.load(f)
    if not os.environ.get("SLURM_JOB_ID"):
        fail("srun outside a job: this emulation runs job steps only (sbatch first)")
    opts, command = parse(argv, set(site["srun_options"]), {k: set(v) for k, v in site["srun_values"].items()})
    job_nodes = int(os.environ.get("SLURM_NNODES", "1"))
    nodes = int(opts.get("-N", job_nodes))
    if nodes > job_nodes:
        fail(f"-N {nodes}: the job has {job_nodes} node(s)")
    per_node = int(opts.get("--ntasks-per-node", 0))
    n = int(opts.get("-n", per_node * nodes or nodes))
    per_node = per_node or -(-n // nodes)
    if n > per_node * nodes:
        fail(f"-n {n} tasks do not fit {nodes} node(s) x {per_node} task(s) per node")
    cpus = int(opts.get("-c", 1))
    if per_node * cpus > site["cpus_per_node"]:
        fail(f"{per_node} tasks x -c {cpus} exceed the {site['cpus_per_node']} CPUs of a node")
    gpus = int(opts.get("--gpus-per-task", 0))
    if per_node * gpus > site["gpus_per_node"]:
        fail(f"{per_node} tasks x --gpus-per-task={gpus} exceed the {site['gpus_per_node']} GPUs of a node")
    kill = opts.get("--kill-on-bad-exit", "0") not in ("0", "")
    ncpu = os.cpu_count() or 1
    spec = []
    for rank in range(n):
        local = rank % per_node
        env = {"SLURM_PROCID": str(rank), "SLURM_LOCALID": str(local), "SLURM_NODEID": str(rank // per_node),
               "SLURM_STEP_NUM_TASKS": str(n), "SLURM_NTASKS": str(n), "SLURM_CPUS_PER_TASK": str(cpus)}
        if gpus == 1 and opts.get("--gpu-bind") == "closest" and site["name"] == "frontier":
            env["ROCR_VISIBLE_DEVICES"] = str(FRONTIER_CLOSEST[local])
        bind = opts.get("--cpu-bind", "cores" if site["name"] == "frontier" else None)
        spec.append({"env": env, "cpus": [local % ncpu] if bind == "cores" else None})
    step = os.path.join(root, "slurm", f"step-{os.environ['SLURM_JOB_ID']}-{os.getpid()}")
    return ranks.run(n, command, {"ranks": spec}, step, kill, "srun.log")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
