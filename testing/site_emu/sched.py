"""The emulated batch schedulers, strict: Slurm (sbatch, scontrol) and PBS Professional (qsub, qstat),
plus `run`, which plays the scheduler: it starts the queued jobs one after the other, each to its end.

What is checked at submission, as the real scheduler refuses (one line, status 1):
  every option and directive against the site's pages (testing/site_emu/facts.py); a project account;
  Frontier's batch node-count bins, extended and debug limits; Polaris's queue table, prod's
  routing and debug-scaling's one job per user.
How a job is started, as the centres' pages describe:
  Slurm: the submission's environment is passed on (--export=ALL, the default), the job starts in
  the submission folder, with SLURM_JOB_ID, SLURM_NNODES, SLURM_SUBMIT_DIR; `scontrol requeue ID`
  starts it again once it ends (same id, Restarts + 1).
  PBS: the job does not get the submission's environment: only -v variables and PBS's own
  (PBS_JOBID, PBS_NODEFILE, PBS_O_WORKDIR, PBS_O_QUEUE, PBS_ACCOUNT), PATH=/usr/bin:/bin, in $HOME,
  with the interpreter of the script's first line (so `module` exists only in a login shell,
  `#!/bin/bash -l`, whose profile sets it up); -W depend=afterany:ID waits for ID.
Jobs live in $EMU_ROOT/sched/<id>.json; each batch shell's pid is recorded there (tests signal it).
"""

import json
import os
import re
import shlex
import subprocess
import sys
import time

ROOT = os.environ["EMU_ROOT"]
STORE = os.path.join(ROOT, "sched")
with open(os.path.join(ROOT, "emu", "site.json")) as _f:
    SITE = json.load(_f)


def fail(tool, message):
    print(f"{tool}: error: {message}", file=sys.stderr)
    sys.exit(1)


def seconds(text):
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text or "")
    if not m:
        return None
    d, a, b, c = (int(x) if x else None for x in m.groups())
    if c is not None:
        h, mi, s = a, b, c
    elif b is not None:
        h, mi, s = (a, b, 0) if d is not None else (0, a, b)
    else:
        h, mi, s = (a, 0, 0) if d is not None else (0, a, 0)
    return (d or 0) * 86400 + h * 3600 + mi * 60 + s


def jobs():
    os.makedirs(STORE, exist_ok=True)
    found = []
    for name in sorted(os.listdir(STORE)):
        if name.endswith(".json"):
            with open(os.path.join(STORE, name)) as f:
                found.append(json.load(f))
    return found


def save(job):
    os.makedirs(STORE, exist_ok=True)
    tmp = os.path.join(STORE, f".{job['seq']}.tmp")
    with open(tmp, "w") as f:
        json.dump(job, f, indent=1)
    os.replace(tmp, os.path.join(STORE, f"{job['seq']}.json"))


def find(job_id):
    for job in jobs():
        if job["id"] == job_id or str(job["seq"]) == job_id.split(".")[0]:
            return job
    return None


def directives(script, prefix):
    words = []
    with open(script) as f:
        lines = f.read().splitlines()
    for line in lines[1:]:
        if line.startswith(prefix + " "):
            words += shlex.split(line[len(prefix) + 1:])
        elif line.strip() and not line.startswith("#"):
            break
    return words


def parse(tool, words, allowed, flags=()):
    opts, i = {}, 0
    while i < len(words):
        a = words[i]
        name, eq, value = a.partition("=") if a.startswith("--") else (a, "", "")
        if name not in allowed and name not in flags:
            fail(tool, f"unrecognized option '{name}'")
        if name in flags:
            opts[name] = ""
        elif eq:
            opts[name] = value
        else:
            i += 1
            if i >= len(words):
                fail(tool, f"option '{name}' requires an argument")
            if name in ("-l", "-v"):
                opts.setdefault(name, []).append(words[i])
            else:
                opts[name] = words[i]
        i += 1
    return opts


def new_seq():
    return 1000 + len(jobs())


# ------------------------------------------------------------------------------------- Slurm

def sbatch(argv):
    parsable = "--parsable" in argv
    argv = [a for a in argv if a != "--parsable"]
    # the script is the first word that is not an option or an option's value
    i, script = 0, None
    allowed = set(SITE["sbatch_options"])
    flags = {"--requeue"}
    while i < len(argv):
        a = argv[i]
        if a.startswith("-"):
            if a in flags or "=" in a:
                i += 1
            else:
                i += 2
            continue
        script = a
        break
    if script is None or not os.path.isfile(script):
        fail("sbatch", f"no batch script (got {script!r})")
    cli = parse("sbatch", argv[:i], allowed, flags)
    opts = parse("sbatch", directives(script, "#SBATCH"), allowed, flags)
    opts.update(cli)
    for name, values in SITE["sbatch_values"].items():
        if name in opts and opts[name] not in values:
            fail("sbatch", f"invalid {name} '{opts[name]}'")
    if not opts.get("-A"):
        fail("sbatch", "Batch job submission failed: Invalid account or account/partition combination specified (no -A)")
    nodes = int(opts.get("-N", "1"))
    limit = seconds(opts.get("-t", "")) or 0
    if SITE["name"] == "frontier":
        partition, qos = opts.get("-p", "batch"), opts.get("-q", "normal")
        if partition == "batch":
            hours = 2 if nodes <= 91 else 6 if nodes <= 183 else 12
            if nodes > 9472 or limit > hours * 3600:
                fail("sbatch", f"Batch job submission failed: Requested time limit is invalid (batch: {nodes} nodes, at most {hours} h)")
        elif partition == "extended" and (nodes > 64 or limit > 24 * 3600):
            fail("sbatch", "Batch job submission failed: the extended partition takes 64 nodes for 24 h at most")
        if qos == "debug" and limit > 2 * 3600:
            fail("sbatch", "Batch job submission failed: the debug QOS takes 2 h at most")
    if SITE["name"] == "perlmutter" and opts.get("-C") != "gpu" and ("--gpus-per-node" in opts or "-G" in opts):
        fail("sbatch", "Batch job submission failed: GPUs need -C gpu")
    seq = new_seq()
    job = {"seq": seq, "id": str(seq), "kind": "slurm", "script": os.path.abspath(script), "opts": opts,
           "env": dict(os.environ), "workdir": os.getcwd(), "state": "queued", "restarts": 0, "requeue": False,
           "depend": None, "nodes": nodes, "name": opts.get("-J", os.path.basename(script))}
    save(job)
    print(seq if parsable else f"Submitted batch job {seq}")


def scontrol(argv):
    if argv[:1] == ["requeue"] and len(argv) == 2:
        job = find(argv[1])
        if job is None or job["kind"] != "slurm":
            fail("scontrol", f"Invalid job id specified: {argv[1]}")
        if "--requeue" not in job["opts"]:
            fail("scontrol", f"Requested operation is presently disabled for job {argv[1]} (submitted without --requeue)")
        job["requeue"] = True
        save(job)
        return
    if argv[:2] == ["show", "job"] and len(argv) == 3:
        job = find(argv[2])
        if job is None:
            fail("scontrol", f"Invalid job id specified: {argv[2]}")
        print(f"JobId={job['id']} JobState={job['state'].upper()} Restarts={job['restarts']} ExitCode={job.get('exit')}")
        return
    fail("scontrol", f"'{' '.join(argv)}' is not emulated (requeue ID, show job ID)")


# ------------------------------------------------------------------------------------- PBS

def _pbs_queue(queue, nodes, limit):
    table = SITE["queues"]
    if queue not in table:
        fail("qsub", f"Unknown queue {queue}")
    lo, hi, hours = table[queue]
    if not lo <= nodes <= hi or not 300 <= limit <= hours * 3600:
        fail("qsub", f"Job violates queue and/or server resource limits ({queue}: {lo}-{hi} nodes, 5 min to {hours} h)")
    if queue != "prod":
        return queue
    for (lo, hi, hours), name in zip(SITE["prod_routes"], ("small", "medium", "large")):
        if lo <= nodes <= hi:
            if limit > hours * 3600:
                fail("qsub", f"Job violates queue and/or server resource limits (prod routes {nodes} nodes to {name}: at most {hours} h)")
            return name
    fail("qsub", "no execution queue of prod takes this job")


def qsub(argv):
    if not argv or argv[-1].startswith("-") or not os.path.isfile(argv[-1]):
        fail("qsub", "a job script is needed as the last argument")
    script = argv[-1]
    allowed = set(SITE["qsub_options"])
    opts = parse("qsub", directives(script, "#PBS"), allowed)
    cli = parse("qsub", argv[:-1], allowed)
    resources = opts.pop("-l", []) + cli.pop("-l", [])
    variables = opts.pop("-v", []) + cli.pop("-v", [])
    opts.update(cli)
    res = {}
    for item in resources:
        for part in item.split(","):
            key, _, value = part.partition("=")
            if key not in ("select", "walltime", "place", "filesystems"):
                fail("qsub", f"Unknown resource Resource_List.{key}")
            res[key] = value
    select = res.get("select", "1")
    m = re.fullmatch(r"(\d+)(?::system=polaris)?(?::ncpus=\d+)?", select)
    if not m:
        fail("qsub", f"illegal -l select={select}")
    nodes = int(m.group(1))
    limit = seconds(res.get("walltime", ""))
    if limit is None:
        fail("qsub", "a walltime is needed (-l walltime=HH:MM:SS)")
    if not opts.get("-A"):
        fail("qsub", "Account_Name is required (qsub -A <project>)")
    queue = opts.get("-q", "prod")
    exec_queue = _pbs_queue(queue, nodes, limit)
    if queue == "debug-scaling" and any(j["queue"] == "debug-scaling" and j["state"] != "done"
                                        for j in jobs() if j["kind"] == "pbs"):
        fail("qsub", "Maximum number of jobs for user in queue debug-scaling exceeded (1 running, accruing or queued)")
    depend = None
    if "-W" in opts:
        dm = re.fullmatch(r"depend=afterany:(\S+)", opts["-W"])
        if not dm:
            fail("qsub", f"illegal -W {opts['-W']}")
        depend = dm.group(1)
    passed = {}
    for item in variables:
        for part in item.split(","):
            key, eq, value = part.partition("=")
            passed[key] = value if eq else os.environ.get(key, "")
    seq = new_seq()
    job = {"seq": seq, "id": f"{seq}.polaris-pbs-01", "kind": "pbs", "script": os.path.abspath(script),
           "opts": opts, "env": passed, "workdir": os.getcwd(), "state": "queued", "restarts": 0, "requeue": False,
           "depend": depend, "nodes": nodes, "queue": queue, "exec_queue": exec_queue,
           "walltime": res["walltime"], "account": opts["-A"], "name": opts.get("-N", os.path.basename(script))}
    save(job)
    print(job["id"])


def qstat(argv):
    if argv[:1] != ["-f"] or len(argv) != 2:
        fail("qstat", "only `qstat -f JOBID` is emulated")
    job = find(argv[1])
    if job is None:
        fail("qstat", f"Unknown Job Id {argv[1]}")
    print(f"Job Id: {job['id']}\n    Job_Name = {job['name']}\n    Account_Name = {job['account']}\n"
          f"    queue = {job['exec_queue']}\n    Resource_List.walltime = {job['walltime']}\n"
          f"    Resource_List.select = {job['nodes']}:system=polaris\n")


# ------------------------------------------------------------------------------------- running

def _interpreter(script):
    with open(script) as f:
        first = f.readline().strip()
    if not first.startswith("#!"):
        return ["/bin/sh"]
    return shlex.split(first[2:])


def start(job):
    script = job["script"]
    home = os.environ["HOME"]
    if job["kind"] == "slurm":
        env = dict(job["env"], SLURM_JOB_ID=job["id"], SLURM_JOBID=job["id"], SLURM_NNODES=str(job["nodes"]),
                   SLURM_JOB_NUM_NODES=str(job["nodes"]), SLURM_SUBMIT_DIR=job["workdir"],
                   SLURM_RESTART_COUNT=str(job["restarts"]), SLURM_JOB_NAME=job["name"])
        cwd = job["workdir"]
        pattern = job["opts"].get("-o", "slurm-%j.out").replace("%x", job["name"]).replace("%j", job["id"])
        out = os.path.join(cwd, pattern)
        mode = "a" if job["opts"].get("--open-mode") == "append" or job["restarts"] else "w"
    else:
        nodefile = os.path.join(STORE, f"{job['seq']}.nodes")
        with open(nodefile, "w") as f:
            f.writelines(f"x3001c0s{i}b0n0.hsn.cm.polaris.alcf.anl.gov\n" for i in range(job["nodes"]))
        # what PBS gives a job: its own variables and -v, not the submission's environment (the
        # emulation's own settings of the machine, TMPDIR and pip's, stay: they are not the site's)
        keep = {k: v for k, v in os.environ.items()
                if k in ("TMPDIR", "LANG", "USER", "LOGNAME") or k.startswith(("PIP_", "BOOSTMPI_CUDAEMU", "BOOSTMPI_STANDIN"))}
        env = dict(keep, HOME=home, SHELL="/bin/bash", PATH="/usr/bin:/bin", PBS_JOBID=job["id"],
                   PBS_NODEFILE=nodefile, PBS_O_WORKDIR=job["workdir"], PBS_O_QUEUE=job["queue"],
                   PBS_QUEUE=job["exec_queue"], PBS_ACCOUNT=job["account"], PBS_JOBNAME=job["name"],
                   **job["env"])
        cwd = home
        out = os.path.join(job["workdir"], f"{job['name']}.o{job['seq']}")
        mode = "a"
    with open(out, mode) as log:
        proc = subprocess.Popen(_interpreter(script) + [script], cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
        job.update(state="running", pid=proc.pid, out=out)
        save(job)
        status = proc.wait()
    job = find(job["id"])
    job["exit"] = status
    if job.get("requeue"):
        job.update(state="queued", requeue=False, restarts=job["restarts"] + 1)
    else:
        job["state"] = "done"
    job.pop("pid", None)
    save(job)


def run(argv):
    deadline = time.time() + float(argv[0]) if argv else None
    while True:
        done = {j["id"] for j in jobs() if j["state"] == "done"}
        ready = [j for j in jobs() if j["state"] == "queued" and (j["depend"] is None or j["depend"] in done)]
        if not ready:
            return 0
        if deadline and time.time() > deadline:
            print("sched: out of time", file=sys.stderr)
            return 1
        start(ready[0])


TOOLS = {"sbatch": sbatch, "scontrol": scontrol, "qsub": qsub, "qstat": qstat, "run": run}

if __name__ == "__main__":
    tool = sys.argv[1]
    sys.exit(TOOLS[tool](sys.argv[2:]) or 0)
