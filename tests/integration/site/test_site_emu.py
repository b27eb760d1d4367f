"""The site scripts and job files of jobs/ run end to end on emulated Frontier, Perlmutter and Polaris
(testing/site_emu: modules, Cray PE paths over Debian's MPICH, cc/nvc, srun/sbatch/scontrol,
qsub/qstat/PALS mpiexec, all strict and built from the centres' pages): the setup script exits 0
with mpi4py on the site's MPI, the job runs 2 ranks of a training run to DONE, the preemption and
requeue chain, the stops that must not resubmit, the checks before submission, the network-plugin
line, the Perlmutter GPU/NUMA check, and each first-run failure put back into a copy of jobs/
fails here.

These need root (mount namespace, chroot) and Debian's mpich, libmpich-dev and patchelf (installed
with apt-get when missing). They run in tests/run.sh's "emulated centres" step (BOOSTMPI_SITE_EMU=1);
under CI=true a missing privilege or package is a failure, not a skip.
"""

import json
import os
import shutil
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from testing.site_emu.build import EmulatedSite, kill_group, prepare_cache

pytestmark = pytest.mark.skipif(os.environ.get("BOOSTMPI_SITE_EMU") != "1",
                                reason="the emulated-site tests run in tests/run.sh's step 'emulated centres' (BOOSTMPI_SITE_EMU=1)")

ACCOUNT = {"frontier": "abc123", "perlmutter": "m1234_g", "polaris": "Proj"}
RUN_DIR = {"frontier": "/lustre/orion/abc123/run", "perlmutter": "/pscratch/sd/u/user/run", "polaris": "/eagle/proj/run"}
APT = ["mpich", "libmpich-dev", "patchelf"]


def _need(condition, why):
    if not condition:
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)


@pytest.fixture(scope="session")
def emu_cache(tmp_path_factory):
    _need(os.geteuid() == 0, "the emulated sites need root (a mount namespace and chroot)")
    if not (shutil.which("mpicc.mpich") and shutil.which("patchelf")):
        _need(shutil.which("apt-get") is not None, "Debian's mpich and patchelf are missing and there is no apt-get")
        subprocess.run(["apt-get", "update", "-qq"], check=False)
        p = subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *APT],
                           env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"), capture_output=True, text=True)
        _need(p.returncode == 0, f"apt-get install {' '.join(APT)} failed: {p.stderr[-300:]}")
    # BOOSTMPI_SITE_EMU_CACHE: keep the wheelhouse and the mpi4py wheels between runs (a developer's loop)
    return prepare_cache(os.environ.get("BOOSTMPI_SITE_EMU_CACHE") or tmp_path_factory.mktemp("site-emu-cache"))


def _build_site(name, root, cache, after=None):
    """The emulated site `name` with its setup script run (result in .setup); `after`: a future to
    wait for first."""
    if after is not None:
        after.result()
    s = EmulatedSite.create(name, root, cache)
    if name == "polaris":
        base = s.polaris_base()
        assert base.returncode == 0, base.stdout[-3000:]
    s.venv = str(s.home / "venv")
    s.setup = s.login(f"BOOSTMPI_VENV={s.venv} bash jobs/setup_{name}.sh", timeout=900)
    return s


@pytest.fixture(scope="session")
def site(emu_cache, tmp_path_factory):
    """site(name): the emulated site with its setup script run once (result in .setup).

    The three sites are built side by side at the first request (each is mostly single-threaded
    pip, Cython-free compiles and venv creation, so two run at once on two cores): Frontier and
    Perlmutter at once, Polaris after Perlmutter, whose Cray MPICH version it shares (its mpi4py
    then comes from the wheel Perlmutter's setup built, never from two builds racing for it)."""
    roots = {name: tmp_path_factory.mktemp(f"emu-{name}") for name in ("frontier", "perlmutter", "polaris")}
    pool = ThreadPoolExecutor(max_workers=3)
    futures = {}
    for name in ("perlmutter", "frontier"):
        futures[name] = pool.submit(_build_site, name, roots[name], emu_cache)
    futures["polaris"] = pool.submit(_build_site, "polaris", roots["polaris"], emu_cache, futures["perlmutter"])
    yield lambda name: futures[name].result()
    pool.shutdown(wait=True)


def job_env(s, **extra):
    env = dict(CONFIG="configs/tiny.toml", TP="2", RANKS_PER_NODE="2", RUN_DIR=RUN_DIR[s.name], BOOSTMPI_VENV=s.venv)
    env.update(extra)
    return env


def submit_and_run(s, *options, timeout=600, **env):
    """bash jobs/submit.sh SITE -A ... OPTIONS, then the emulated scheduler runs the queue."""
    opts = " ".join(options)
    return s.login(f'bash jobs/submit.sh {s.name} -A {ACCOUNT[s.name]} {opts} && '
                   f'"$EMU_PYTHON" "$EMU_ROOT/emu/sched.py" run {timeout}', timeout=timeout + 60, **job_env(s, **env))


def jobs(s):
    return [json.loads(p.read_text()) for p in sorted((s.root / "sched").glob("*.json"))]


def output(s, job):
    return Path(job["out"]).read_text() if job.get("out") else ""


def clear(s):
    """Forget the queue and the run directory (a fresh run on the same site)."""
    for p in (s.root / "sched").glob("*"):
        p.unlink()
    for p in [*s.repo.glob("boostmpi-*.out"), *s.repo.glob("boostmpi.o*")]:
        p.unlink()
    shutil.rmtree(run_dir(s), ignore_errors=True)


def run_dir(s):
    """The job's RUN_DIR (a path on the site's file system) as seen from outside the chroot."""
    top, _, rest = RUN_DIR[s.name].lstrip("/").partition("/")
    if top == "lustre":  # /lustre is root/lustre
        return s.root / RUN_DIR[s.name].lstrip("/")
    return s.root / top / rest


class mutated:
    """A change to a file of the site's repository copy for the duration of a `with` block."""

    def __init__(self, s, rel, old, new):
        self.path, self.old, self.new = s.repo / rel, old, new

    def __enter__(self):
        self.text = self.path.read_text()
        assert self.old in self.text, f"mutation anchor not found in {self.path}: {self.old[:80]!r}"
        self.path.write_text(self.text.replace(self.old, self.new))

    def __exit__(self, *exc):
        self.path.write_text(self.text)


def rerun_setup(s, venv):
    return s.login(f"BOOSTMPI_VENV={venv} bash jobs/setup_{s.name}.sh", timeout=900)


# ---------------------------------------------------------------------------------------- setup

MODULES_LOADED = {
    # OLCF "Installing CuPy", Frontier tab
    "frontier": ["PrgEnv-gnu/8.7.0", "cpe/26.03", "miniforge3/23.11.0-0", "rocm/7.0.2", "craype-accel-amd-gfx90a",
                 "rccl-net-plugin"],
    "perlmutter": ["PrgEnv-gnu/8.5.0", "cudatoolkit/12.4", "craype-accel-nvidia80", "nccl/2.24.3", "python/3.11"],
    # ALCF "Python": module use /soft/modulefiles; module load conda
    "polaris": ["conda/2025-09-25", "craype-accel-nvidia80"],
}
SITE_MPICH = {"frontier": "9.1.0", "perlmutter": "8.1.30", "polaris": "8.1.30"}


@pytest.mark.parametrize("name", ["frontier", "perlmutter", "polaris"])
def test_setup_exits_0_with_mpi4py_on_the_site_mpi(site, name):
    s = site(name)
    assert s.setup.returncode == 0, s.setup.stdout[-4000:]
    assert "venv ready" in s.setup.stdout
    mpi = f"/opt/cray/pe/mpich/{SITE_MPICH[name]}/ofi/gnu/12.3/lib/libmpi_gnu_123.so.12"
    assert f"MPICH Version:" in s.setup.stdout and mpi in s.setup.stdout, s.setup.stdout[-2000:]
    loads = s.log("module.log").split()
    for module in MODULES_LOADED[name]:
        assert module in loads, (module, loads)
    packages = s.login(f"{s.venv}/bin/python -m pip list --format=freeze").stdout
    assert "mpich==" not in packages.lower()
    if name == "polaris":  # ALCF-PYTHON: the venv on top of the conda base takes the base's mpi4py as it is
        assert "the conda base's mpi4py is not on" not in s.setup.stdout, s.setup.stdout[-2000:]
    if name == "frontier":
        assert "cupy-rocm-7-0==14.2.0" in packages  # CuPy's ROCm 7 wheel, not a source build
    else:
        assert "cupy-cuda12x==" in packages
        assert "nvidia-nccl" not in packages  # one NCCL: the site's


@pytest.mark.parametrize("name", ["frontier", "perlmutter", "polaris"])
def test_job_runs_two_ranks_to_done(site, name):
    s = site(name)
    clear(s)
    p = submit_and_run(s, "-N", "1", "-t", "00:30:00")
    assert p.returncode == 0, p.stdout[-3000:]
    (job,) = jobs(s)
    out = output(s, job)
    assert job["exit"] == 0, out[-4000:]
    assert "job: network plugin: " in out and "(one node: not used)" in out
    compiled, started = out.index("job: GPU kernels compiled once into"), out.index("starting at checkpoint step 0")
    assert compiled < started  # before any rank
    mpi = [line for line in out.splitlines() if line.startswith("mpi: ")]
    assert mpi and "libmpi_gnu_123.so.12" in mpi[0] and "2 rank(s) on 1 node(s)" in mpi[0], mpi
    assert "job: finished all 4 steps" in out
    ranks = [json.loads(line) for line in s.log("srun.log" if name != "polaris" else "mpiexec.log").splitlines()]
    assert ranks[-1]["ranks"] == 2


# ------------------------------------------------------------------------------ before submission

def test_bad_site_settings_get_one_line_before_submission(site):
    f = site("frontier")
    clear(f)
    cases = [
        (f, "", {}, "error: no project account: add -A <project> (the allocation this job is charged to)"),
        (f, f"-A {ACCOUNT['frontier']} -N 100 -t 07:00:00", {},  # OLCF: 92-183 nodes, at most 6 h
         "error: queue batch takes 92-183 nodes for 5 min to 6 h (bin 4), not 100 nodes for 420 min"),
        (f, f"-A {ACCOUNT['frontier']}", {"BOOSTMPI_ROCM": "6.2.4"},
         "error: the frontier environment does not load: error: rocm/6.2.4 is not listed with cpe/26.03"),
        (f, f"-A {ACCOUNT['frontier']}", {"BOOSTMPI_PYTHON_MODULE": "cray-python"},
         "error: the frontier environment does not load: Lmod has detected the following error:  The following module(s) are unknown: \"cray-python\""),
    ]
    for s, options, env, line in cases:
        p = s.login(f"bash jobs/submit.sh {s.name} {options}", **job_env(s, **env))
        assert p.returncode == 2, p.stdout
        assert p.stdout.strip().splitlines()[-1].startswith(line), p.stdout
        assert not jobs(s)  # nothing submitted


def test_polaris_queue_table_before_submission(site):
    s = site("polaris")
    clear(s)
    for options, line in [
        ("-N 3 -q debug -t 01:00:00", "error: queue debug takes 1-2 nodes for 5 min to 1 h, not 3 nodes for 60 min"),
        ("-N 10 -q prod -t 06:00:00",  # ALCF: prod routes 10-24 nodes to small, at most 3 h
         "error: queue prod (routed to small) takes 10-24 nodes for 5 min to 3 h, not 10 nodes for 360 min"),
    ]:
        p = s.login(f"bash jobs/submit.sh polaris -A {ACCOUNT['polaris']} {options}", **job_env(s))
        assert p.returncode == 2 and p.stdout.strip().splitlines()[-1] == line, p.stdout
        assert not jobs(s)


# ------------------------------------------------------------------------------------ the chain

def _preempt_when_training(s, steps_before=3, timeout=300):
    """Run the scheduler in the background; once the run has logged `steps_before` steps, send
    SIGUSR1 to the running batch shell (as Slurm's --signal=B:USR1 does). Returns the scheduler's output."""
    sched = s.enter_async(["/bin/bash", "-l", "-c", '"$EMU_PYTHON" "$EMU_ROOT/emu/sched.py" run 600'])
    metrics = run_dir(s) / "metrics.jsonl"
    deadline = time.time() + timeout
    signalled = False
    try:
        while sched.poll() is None and time.time() < deadline:
            rows = len(metrics.read_text().splitlines()) if metrics.exists() else 0
            running = [j for j in jobs(s) if j["state"] == "running" and "pid" in j]
            if not signalled and rows >= steps_before and running:
                os.kill(running[0]["pid"], signal.SIGUSR1)
                signalled = True
            time.sleep(0.2)
        out, _ = sched.communicate(timeout=max(1, deadline - time.time()))
    finally:
        kill_group(sched)
    assert signalled, out[-3000:]
    return out


def test_slurm_preemption_requeues_and_resumes_to_done(site):
    s = site("frontier")
    clear(s)
    p = s.login(f"bash jobs/submit.sh frontier -A {ACCOUNT['frontier']} -N 1 -t 00:30:00",
                **job_env(s, CONFIG=config(s, 20)))
    assert p.returncode == 0, p.stdout
    _preempt_when_training(s)
    (job,) = jobs(s)
    out = output(s, job)
    assert job["restarts"] == 1 and job["exit"] == 0, out[-4000:]
    assert "job: received SIGUSR1" in out and "stopped by signal at step" in out
    assert "the ranks stopped on a signal with a checkpoint" in out and "queueing the next attempt" in out
    assert "job: finished all 20 steps" in out and "resumed from" in out
    steps = [json.loads(line)["step"] for line in (run_dir(s) / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 21))  # each step once: the second attempt resumed where the first stopped


def config(s, steps):
    """configs/tiny.toml with train.steps = steps, in the site's repository copy (its relative path)."""
    rel = f"configs/tiny-{steps}.toml"
    text = (s.repo / "configs" / "tiny.toml").read_text()
    assert "\nsteps = 4\n" in text
    (s.repo / rel).write_text(text.replace("\nsteps = 4\n", f"\nsteps = {steps}\n"))
    return rel


def test_stops_that_must_not_resubmit(site):
    s = site("perlmutter")
    clear(s)
    # a run that is finished: DONE, and a second submission does nothing
    assert submit_and_run(s, "-N", "1", "-t", "00:30:00").returncode == 0
    assert submit_and_run(s, "-N", "1", "-t", "00:30:00").returncode == 0
    first, second = jobs(s)
    assert "DONE exists: this run is finished" in output(s, second)
    assert first["restarts"] == second["restarts"] == 0
    # a real failure (a configuration the trainer refuses): status 2, no requeue
    clear(s)
    p = submit_and_run(s, "-N", "1", "-t", "00:30:00", CONFIG="configs/does-not-exist.toml")
    (job,) = jobs(s)
    out = output(s, job)
    assert job["exit"] != 0 and job["restarts"] == 0, out[-3000:]
    assert "without stopping on a signal" in out and "the chain stops here" in out


# ------------------------------------------------------------------------- network plugin, NUMA

def test_multi_node_job_names_its_plugin_and_stops_without_one(site):
    s = site("perlmutter")
    clear(s)
    p = submit_and_run(s, "-N", "2", "-t", "00:30:00", RANKS_PER_NODE="1")
    (job,) = jobs(s)
    out = output(s, job)
    assert job["exit"] == 0, out[-3000:]
    assert "job: network plugin: " in out and "(NCCL_NET=AWS Libfabric, required on 2 nodes)" in out
    plugin = s.root / "sw" / "nccl" / "lib" / "libnccl-net.so"
    saved = plugin.read_bytes()
    plugin.unlink()
    try:
        clear(s)
        submit_and_run(s, "-N", "2", "-t", "00:30:00", RANKS_PER_NODE="1")
        (job,) = jobs(s)
        out = output(s, job)
        assert job["exit"] == 2
        assert "error: no NCCL/RCCL network plugin (lib*ccl-net*.so) on LD_LIBRARY_PATH or NCCL_NET_PLUGIN for this 2-node job" in out
        assert "starting at checkpoint" not in out  # nothing launched
    finally:
        plugin.write_bytes(saved)


def test_perlmutter_rank_on_the_wrong_numa_domain_stops(site):
    s = site("perlmutter")
    clear(s)
    nodes = s.root / "sysfs" / "devices" / "system" / "node"
    saved = {n: (nodes / n / "cpulist").read_text() for n in ("node0", "node1")}
    # CPU 0 on NUMA node 1 and CPU 1 on NUMA node 0: the ranks' cores no longer sit by the GPUs they take
    (nodes / "node0" / "cpulist").write_text(saved["node1"])
    (nodes / "node1" / "cpulist").write_text(saved["node0"])
    try:
        submit_and_run(s, "-N", "1", "-t", "00:30:00")
        (job,) = jobs(s)
        out = output(s, job)
        assert job["exit"] != 0, out[-3000:]
        # both ranks are misplaced; whichever reaches its check first stops the job (srun's
        # --kill-on-bad-exit ends the other, possibly before it prints)
        lines = ["error: local rank 0 would take the GPU at 00000000:C7:00.0 on NUMA node 0, but its cores 0 are on NUMA node(s) 1",
                 "error: local rank 1 would take the GPU at 00000000:87:00.0 on NUMA node 1, but its cores 1 are on NUMA node(s) 0"]
        assert any(line in out for line in lines), out[-3000:]
    finally:
        for n, text in saved.items():
            (nodes / n / "cpulist").write_text(text)


# ------------------------------------------------------------- the first-run failures, put back
# Each test puts one failure of the earlier jobs/ back into the site's repository copy and shows
# that the emulated site catches it; the tests above pass on the real scripts.

OLD_SITE_MPI_CHECK = '''  library="$(boostmpi_mpi4py_library)"
  case "$library" in
    *"/opt/cray/pe/mpich"*) echo "mpi4py in $VENV uses $library" ;;
    *) echo "error: mpi4py in $VENV is linked against '${library:-no MPI library}', not the site MPI" >&2; exit 1 ;;
  esac'''


def test_put_back_1_path_pattern_mpi_check_rejects_the_site_mpi(site):
    s = site("perlmutter")
    line = '  boostmpi_check_site_venv "${MPICH_DIR:?the cray-mpich module did not set MPICH_DIR}/lib/libmpi*.so*"'
    with mutated(s, "jobs/setup_env.sh", line, OLD_SITE_MPI_CHECK):
        p = rerun_setup(s, s.venv)
    assert p.returncode == 1
    assert "is linked against '/opt/cray/pe/lib64/libmpi_gnu_123.so.12', not the site MPI" in p.stdout, p.stdout[-2000:]


def test_put_back_2_frontier_modules_and_cupy(site):
    s = site("frontier")
    # the Python module of the earlier script: not on OLCF's Python page, unknown on the emulated Frontier
    with mutated(s, "jobs/setup_frontier.sh", "${BOOSTMPI_PYTHON_MODULE:-miniforge3/23.11.0-0}",
                 "${BOOSTMPI_PYTHON_MODULE:-cray-python}"):
        p = rerun_setup(s, s.venv)
    assert p.returncode == 2 and 'The following module(s) are unknown: "cray-python"' in p.stdout, p.stdout[-2000:]
    # the non-default cpe without CRAY_LD_LIBRARY_PATH first: mpi4py loads the default cray-mpich
    with mutated(s, "jobs/setup_frontier.sh", 'export LD_LIBRARY_PATH="${CRAY_LD_LIBRARY_PATH:?',
                 'true "${CRAY_LD_LIBRARY_PATH:?'):
        p = rerun_setup(s, s.venv)
    assert p.returncode == 1, p.stdout[-2000:]
    assert "runs on /opt/cray/pe/mpich/8.1.31/ofi/gnu/12.3/lib/libmpi_gnu_123.so.12" in p.stdout  # not 9.1.0's
    # ROCm's default (6.2.4) with cpe/26.03: not a pair of OLCF's table
    with mutated(s, "jobs/setup_frontier.sh", 'FRONTIER_ROCM="${BOOSTMPI_ROCM:-7.0.2}"', 'FRONTIER_ROCM=6.2.4'):
        p = rerun_setup(s, s.venv)
    assert p.returncode == 2 and "rocm/6.2.4 is not listed with cpe/26.03" in p.stdout
    # CuPy 12.3 from source: no such CuPy is offered for ROCm 7 (the index has the wheels the pages name)
    with mutated(s, "jobs/setup_frontier.sh", '"cupy-rocm-7-0==${BOOSTMPI_CUPY_VERSION:-14.2.0}"',
                 '--no-binary=cupy "cupy==12.3.0"'):
        p = rerun_setup(s, s.venv)
    assert p.returncode != 0 and "No matching distribution found for cupy==12.3.0" in p.stdout


def test_put_back_3_polaris_mpi4py_built_by_nvc(site):
    s = site("polaris")
    old = '''  setup_venv ""                                          # mpi4py: the conda base's, if it is on the site MPI'''
    # the site's venv: the mutated script goes straight to building mpi4py, which fails before
    # anything is installed into it
    with mutated(s, "jobs/setup_polaris.sh", old, '  BOOSTMPI_MPICC="cc -shared" setup_venv ""'):
        p = rerun_setup(s, s.venv)
    assert p.returncode == 1
    assert "nvc-Error-Unknown switch: -Wsign-compare" in p.stdout, p.stdout[-2000:]


def _polaris_job(s, *options, **env):
    clear(s)
    p = submit_and_run(s, *options, **env)
    (job, *rest) = jobs(s)
    return p, job, output(s, job), rest


def test_put_back_4_polaris_job_shell_and_queues(site):
    s = site("polaris")
    # not a login shell: PBS's environment has no qstat, module or conda
    with mutated(s, "jobs/polaris.pbs", "#!/bin/bash -l\n", "#!/bin/bash\n"):
        _, job, out, _ = _polaris_job(s, "-N", "1", "-t", "00:30:00")
    assert job["exit"] != 0 and "qstat: command not found" in out, out[-2000:]
    # conda activate under set -u: its activation scripts read unset variables (jobs/submit.sh, which
    # loads the job's environment under set -u before submitting, already stops there)
    with mutated(s, "jobs/setup_polaris.sh", "  case $- in *u*) had_u=1; set +u ;; esac\n", ""):
        clear(s)
        p = submit_and_run(s, "-N", "1", "-t", "00:30:00")
    assert p.returncode == 2 and not jobs(s), p.stdout[-2000:]
    assert "error: the polaris environment does not load:" in p.stdout and "CONDA_BUILD: unbound variable" in p.stdout
    # prod's routing table: 10 nodes for 6 h passes the old one-line table, and qsub refuses it later
    sites = (s.repo / "jobs" / "sites.sh").read_text()
    routing = sites[sites.index("    prod)\n"):sites.index("      fi ;;\n", sites.index("    prod)\n")) + len("      fi ;;\n")]
    with mutated(s, "jobs/sites.sh", routing, '    prod) _boostmpi_limits_problem prod 10 496 24 "$nodes" "$seconds" ;;\n'):
        clear(s)
        p = s.login(f"bash jobs/submit.sh polaris -A {ACCOUNT['polaris']} -N 10 -q prod -t 06:00:00", **job_env(s))
    assert "qsub: error: Job violates queue and/or server resource limits" in p.stdout, p.stdout


def test_debug_scaling_job_stops_without_a_successor_and_chaining_there_fails(site):
    """ALCF: debug-scaling takes one job running, accruing or queued per user. A job stopped before
    its walltime queues no successor there; put back, the successor qsub is refused."""
    s = site("polaris")

    def run_stopping_job():
        clear(s)
        cfg = config(s, 400)
        v = (f"TP=2,PP=1,CONFIG={cfg},RUN_DIR={RUN_DIR['polaris']},COMM=nccl,RANKS_PER_NODE=2,"
             f"BOOSTMPI_VENV={s.venv},STOP_AFTER_S=12")
        return s.login(f"qsub -A {ACCOUNT['polaris']} -q debug-scaling -l select=1:system=polaris "
                       f"-l walltime=00:30:00 -v {v} jobs/polaris.pbs && "
                       f'"$EMU_PYTHON" "$EMU_ROOT/emu/sched.py" run 600', timeout=700)

    p = run_stopping_job()
    (job,) = jobs(s)
    out = output(s, job)
    assert job["exit"] == 0, out[-3000:]
    assert "this job queues no successor" in out and "stopped on SIGTERM" in out  # PALS forwards SIGTERM
    with mutated(s, "jobs/polaris.pbs", 'if [ "$QUEUE" = debug-scaling ]; then', "if false; then"):
        run_stopping_job()
    (job,) = jobs(s)
    out = output(s, job)
    assert job["exit"] != 0 and "Maximum number of jobs for user in queue debug-scaling exceeded" in out, out[-3000:]


# failure 5 (requeue decided from exit status 75) is put back in tests/integration/site/test_jobs.py, where the launcher's
# status is made 128 + SIGKILL deterministically.


def test_put_back_6_a_second_nccl_in_the_venv(site):
    s = site("perlmutter")
    with mutated(s, "jobs/setup_perlmutter.sh", '  boostmpi_cray_site_venv perlmutter ""\n',
                 '  boostmpi_cray_site_venv perlmutter gpu\n'):
        with mutated(s, "jobs/setup_perlmutter.sh", "  boostmpi_check_one_nccl\n", ""):
            p = rerun_setup(s, str(s.home / "venv-gpu-extra"))
    assert p.returncode == 0, p.stdout[-2000:]
    packages = s.login(f"{s.home / 'venv-gpu-extra'}/bin/python -m pip list --format=freeze").stdout
    assert "nvidia-nccl-cu12==" in packages  # what test_setup_exits_0_with_mpi4py_on_the_site_mpi refuses
    # and the check the setup script runs refuses that venv with one line
    p = s.login(f"PY={s.home / 'venv-gpu-extra'}/bin/python VENV=x; . jobs/setup_env.sh; boostmpi_check_one_nccl")
    assert p.returncode == 1 and "holds nvidia-nccl-cu12==2.32.3, a second NCCL beside the site's" in p.stdout


def test_put_back_7_local_rank_takes_gpu_r(site):
    """Without jobs/gpu_numa.py in the launch line, ranks take GPU `local rank` whatever their NUMA
    domain: the mismatched layout of test_perlmutter_rank_on_the_wrong_numa_domain_stops goes unnoticed."""
    s = site("perlmutter")
    nodes = s.root / "sysfs" / "devices" / "system" / "node"
    saved = {n: (nodes / n / "cpulist").read_text() for n in ("node0", "node1")}
    (nodes / "node0" / "cpulist").write_text(saved["node1"])
    (nodes / "node1" / "cpulist").write_text(saved["node0"])
    try:
        with mutated(s, "jobs/perlmutter.sbatch", ' "$PY" "$REPO/jobs/gpu_numa.py" --)', ")"):
            clear(s)
            submit_and_run(s, "-N", "1", "-t", "00:30:00")
        (job,) = jobs(s)
        assert job["exit"] == 0 and "would take the GPU" not in output(s, job)
    finally:
        for n, text in saved.items():
            (nodes / n / "cpulist").write_text(text)
