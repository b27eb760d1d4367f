"""The emulated PALS `mpiexec` of Polaris (/opt/cray/pals/<version>/bin/mpiexec), strict: only the
options of ALCF "Running Jobs on Polaris" (-n/--np, --ppn/-ppn, --depth/-d, --cpu-bind, --env,
--hostfile), a hostfile with enough nodes for -n/--ppn, --ppn x --depth within the 64 hardware
threads of a node, and a call inside a PBS job; otherwise one line, status 1. It runs the ranks on
this machine (testing/site_emu/ranks.py) with PMI_LOCAL_RANK and PMI_LOCAL_SIZE (which ALCF's
set_affinity_gpu_polaris.sh reads), binds each to one CPU with --cpu-bind depth, and forwards
SIGTERM/SIGINT/SIGUSR1 to them."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ranks  # noqa: E402

ALIASES = {"--np": "-n", "-ppn": "--ppn", "-d": "--depth", "-env": "--env"}


def fail(message):
    print(f"mpiexec: {message}", file=sys.stderr)
    sys.exit(1)


def main(argv):
    root = os.environ["EMU_ROOT"]
    with open(os.path.join(root, "emu", "site.json")) as f:
        site = json.load(f)
    if not os.environ.get("PBS_JOBID"):
        fail("PALS mpiexec runs inside a PBS job only")
    allowed, values = set(site["mpiexec_options"]), site["mpiexec_values"]
    opts, env, i = {}, {}, 0
    while i < len(argv) and argv[i].startswith("-"):
        name, eq, value = argv[i].partition("=")
        if name not in allowed:
            fail(f"unknown option {name}")
        if not eq:
            i += 1
            if i >= len(argv):
                fail(f"option {name} needs a value")
            value = argv[i]
        name = ALIASES.get(name, name)
        if name in values and value not in values[name]:
            fail(f"invalid {name} {value}")
        if name == "--env":
            key, _, v = value.partition("=")
            env[key] = v
        else:
            opts[name] = value
        i += 1
    command = argv[i:]
    if not command:
        fail("no program to run")
    hostfile = opts.get("--hostfile", os.environ.get("PBS_NODEFILE", ""))
    with open(hostfile) as f:
        hosts = sorted({line.strip() for line in f if line.strip()})
    n = int(opts.get("-n", len(hosts)))
    ppn = int(opts.get("--ppn", -(-n // len(hosts))))
    if n > ppn * len(hosts):
        fail(f"-n {n} ranks do not fit {len(hosts)} node(s) x --ppn {ppn}")
    if ppn * int(opts.get("--depth", 1)) > 64:
        fail(f"--ppn {ppn} x --depth {opts['--depth']} exceed the 64 hardware threads of a node")
    ncpu = os.cpu_count() or 1
    spec = [{"env": dict(env, PMI_LOCAL_RANK=str(r % ppn), PMI_LOCAL_SIZE=str(ppn), PALS_NODEID=str(r // ppn)),
             "cpus": [r % ppn % ncpu] if opts.get("--cpu-bind") in ("depth", "core") else None} for r in range(n)]
    step = os.path.join(root, "pbs", f"step-{os.environ['PBS_JOBID']}-{os.getpid()}")
    return ranks.run(n, command, {"ranks": spec}, step, True, "mpiexec.log")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
