"""Running a job step's ranks on this machine, for the emulated srun and PALS mpiexec.

The ranks need a PMI server to form MPI_COMM_WORLD: Debian's Hydra (`mpiexec.mpich`) starts them,
each through `ranks.py --rank STEPDIR ...`, which sets what the site's launcher sets per rank
(SLURM_PROCID/SLURM_LOCALID or PMI_LOCAL_RANK, CPU binding), runs the command as its child and
reports the child's pid and exit status in STEPDIR. The launcher itself forwards its stop signals
to those pids and, with kill-on-bad-exit, kills the other ranks when one exits non-zero; its
status is then 128 + SIGKILL, as srun reports a step whose tasks it killed.
"""

import json
import os
import signal
import subprocess
import sys
import time

FORWARDED = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT)


def run(nranks, command, per_rank, step_dir, kill_on_bad_exit, log_name):
    """Start `command` on `nranks` ranks; per_rank: JSON-able {"env": {...}, "cpu_bind": bool, "local": [..]}."""
    os.makedirs(step_dir, exist_ok=True)
    with open(os.path.join(step_dir, "spec.json"), "w") as f:
        json.dump(per_rank, f)
    root = os.environ["EMU_ROOT"]
    with open(os.path.join(root, "log", log_name), "a") as f:
        f.write(json.dumps({"ranks": nranks, "command": command}) + "\n")
    # fork on this machine: Hydra would otherwise read the job's node list (PBS_NODEFILE, SLURM_*) and ssh
    hydra = subprocess.Popen(["mpiexec.mpich", "-launcher", "fork", "-rmk", "user", "-n", str(nranks), sys.executable,
                              os.path.abspath(__file__), "--rank", step_dir, "--", *command])
    received = []

    def forward(signum, frame):
        received.append(signum)
        for pid in _pids(step_dir):
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    for sig in FORWARDED:
        signal.signal(sig, forward)
    killed = False
    while hydra.poll() is None:
        time.sleep(0.1)
        if kill_on_bad_exit and not killed:
            bad = [s for s in _statuses(step_dir).values() if s != 0]
            if bad:
                killed = True
                for pid in _pids(step_dir):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
    statuses = _statuses(step_dir)
    if killed and any(s == -signal.SIGKILL for s in statuses.values()):
        return 128 + signal.SIGKILL
    worst = 0
    for s in statuses.values():
        worst = max(worst, 128 - s if s < 0 else s)
    return worst or hydra.returncode


def _pids(step_dir):
    pids = []
    for name in os.listdir(step_dir):
        if name.endswith(".pid"):
            try:
                with open(os.path.join(step_dir, name)) as f:
                    pids.append(int(f.read()))
            except (OSError, ValueError):
                pass
    return pids


def _statuses(step_dir):
    found = {}
    for name in os.listdir(step_dir):
        if name.endswith(".status"):
            with open(os.path.join(step_dir, name)) as f:
                text = f.read().strip()
            if text:
                found[name] = int(text)
    return found


def rank_main(step_dir, command):
    rank = int(os.environ.get("PMI_RANK", "0"))
    with open(os.path.join(step_dir, "spec.json")) as f:
        spec = json.load(f)
    mine = spec["ranks"][rank]
    env = dict(os.environ, **mine["env"])
    if mine.get("cpus") is not None:
        os.sched_setaffinity(0, set(mine["cpus"]))
    for sig in FORWARDED:  # the launcher signals the command itself
        signal.signal(sig, signal.SIG_IGN)
    # close_fds=False: the PMI connection Hydra handed this process (PMI_FD) must reach the rank
    child = subprocess.Popen(command, env=env, preexec_fn=_default_signals, close_fds=False)
    with open(os.path.join(step_dir, f"{rank}.pid"), "w") as f:
        f.write(str(child.pid))
    status = child.wait()
    with open(os.path.join(step_dir, f"{rank}.status.tmp"), "w") as f:
        f.write(str(status))
    os.replace(os.path.join(step_dir, f"{rank}.status.tmp"), os.path.join(step_dir, f"{rank}.status"))
    return 128 - status if status < 0 else status


def _default_signals():
    for sig in FORWARDED:
        signal.signal(sig, signal.SIG_DFL)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rank"]:
        sep = sys.argv.index("--")
        sys.exit(rank_main(sys.argv[2], sys.argv[sep + 1:]))
    sys.exit("usage: ranks.py --rank STEPDIR -- COMMAND...")
