"""Fault tests: real 4-rank training jobs under mpiexec (each under `timeout`), killed, signalled,
corrupted and broken on purpose.

* kill -9 of one rank mid-step ends every rank within 30 s with a non-zero status, and the
  restart continues the losses of an uninterrupted run exactly;
* a kill while a checkpoint is being written leaves the previous one loadable and the partial
  one ignored;
* SIGTERM (to every rank) or SIGINT (Ctrl-C, to mpiexec) writes a checkpoint and exits 75; the
  rerun resumes and ends like the uninterrupted run;
* a truncated or bit-flipped model.h5 is refused (exit 2) with a message naming the file;
* a full disk (or a file-size limit) while checkpointing ends every rank with one line naming the
  space needed, exit 2, the previous checkpoint and `latest` untouched, no temporary folder left;
* an exception on one rank ends every rank within seconds, naming the rank;
* the watchdog ends a collective that a peer never joins, naming the axis and the call.

Faults inside a rank are injected by a small launcher (FAULT_LAUNCHER) that patches one function
before running the real `boostmpi` command line; nothing in the package is test-only.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.support.mpi_helpers import MPIEXEC

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable
RANKS = 4
STEPS = 120
EVERY = 10
JOB_TIMEOUT_S = 90  # the `timeout` around every mpiexec: a hang fails the test instead of the suite

pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec next to the interpreter or on PATH")

FAULT_LAUNCHER = textwrap.dedent('''
    """Runs `boostmpi ARGS...` with one fault injected, chosen by BOOSTMPI_FAULT."""
    import os
    import signal
    import sys

    from mpi4py import MPI

    fault = os.environ["BOOSTMPI_FAULT"]
    rank = MPI.COMM_WORLD.Get_rank()
    if fault == "raise-on-rank-2":  # an exception in the middle of training, on one rank only
        from boostmpi.data import shards

        next_batch = shards.TrainLoader.next_batch
        calls = [0]

        def failing_next_batch(self):
            calls[0] += 1
            if rank == 2 and calls[0] == 5:
                raise RuntimeError("injected failure")
            return next_batch(self)

        shards.TrainLoader.next_batch = failing_next_batch
    elif fault.startswith("hold-before-batch-"):
        # every rank waits before its N-th batch (no collective open) while the file BOOSTMPI_FAULT_GATE
        # exists: the run stays alive, holding its run directory, for as long as the test needs
        import time

        from boostmpi.data import shards

        next_batch, at, calls = shards.TrainLoader.next_batch, int(fault.rsplit("-", 1)[1]), [0]

        def held_next_batch(self):
            calls[0] += 1
            while calls[0] == at and os.path.exists(os.environ["BOOSTMPI_FAULT_GATE"]):
                time.sleep(0.02)
            return next_batch(self)

        shards.TrainLoader.next_batch = held_next_batch
    elif "-while-saving-step-" in fault:
        # kill-while-saving-step-N: rank 0 gets SIGKILL between model.h5 and the rest;
        # kill-rank-1-while-saving-step-N: rank 1 gets it once its own file is written, the others still writing
        from boostmpi import checkpoint

        # stop-rank-1-while-saving-step-N: rank 1 is stopped (SIGSTOP) there instead: alive, never answering
        import time

        kill_step = int(fault.rsplit("-", 1)[1])
        victim, at = (1, "rank file") if fault.startswith(("kill-rank-1-", "stop-rank-1-")) else (0, "model.h5")
        how = signal.SIGSTOP if fault.startswith("stop-") else signal.SIGKILL
        from boostmpi.checkpoint import writer

        save, armed = checkpoint.save, [False]

        def die(stage):  # a stage of the save of step N reached on the victim rank
            if armed[0] and stage == at and rank == victim:
                if os.environ.get("BOOSTMPI_FAULT_NOTE"):  # when it happened, for the test to measure from
                    with open(os.environ["BOOSTMPI_FAULT_NOTE"], "w") as note:
                        note.write(f"{how.name} {time.time():.3f}\\n")
                os.kill(os.getpid(), how)

        def then_die(function, stage):
            def wrapped(*args, **kwargs):
                result = function(*args, **kwargs)
                die(stage)
                return result
            return wrapped

        # the stages, from outside the product: this rank's file written, or rank 0's model.h5 written
        writer.write_rank_file = then_die(writer.write_rank_file, "rank file")
        writer.write_file_image = then_die(writer.write_file_image, "rank file")
        writer.write_virtual_files = then_die(writer.write_virtual_files, "model.h5")

        def save_then_die(run_dir, step, *args, **kwargs):
            armed[0] = step == kill_step
            return save(run_dir, step, *args, **kwargs)

        checkpoint.save = save_then_die
    elif fault == "slow-stop-save":
        # the checkpoint a stop signal asks for takes 8 s: time for a second Ctrl-C while it is written
        import time

        from boostmpi.train import trainer

        save_checkpoint = trainer.Trainer.save_checkpoint

        def slow_save_checkpoint(self):
            if self.preemption.signal is not None:
                time.sleep(8)
            return save_checkpoint(self)

        stop_at_boundary = trainer.Trainer._stop_at_boundary

        def slow_stop_at_boundary(self, last_val):
            # a signal that came while a periodic checkpoint was written (not slowed: no signal yet) stops
            # at that checkpoint's step without another save; the stop is as slow there too
            every = self.cfg.checkpoint.every
            if every and self.step % every == 0:
                time.sleep(8)
            return stop_at_boundary(self, last_val)

        trainer.Trainer.save_checkpoint = slow_save_checkpoint
        trainer.Trainer._stop_at_boundary = slow_stop_at_boundary
    elif fault.startswith("sigterm-in-validation-at-step-"):
        # Slurm's SIGTERM to every task while validation runs, after the step's all-reduce
        from boostmpi.train import trainer

        validate, at = trainer.Trainer.validate, int(fault.rsplit("-", 1)[1])

        def signalled_validate(self):
            if self.step == at:
                os.kill(os.getpid(), signal.SIGTERM)
            return validate(self)

        trainer.Trainer.validate = signalled_validate
    elif fault.startswith("sigusr1-on-rank-1-after-the-all-reduce-of-step-"):
        # one rank alone is signalled, after the step's merged all-reduce (while it makes the metrics row)
        from boostmpi.train import metrics

        step_row, at = metrics.step_row, int(fault.rsplit("-", 1)[1])

        def signalling_step_row(step, *args, **kwargs):
            if step == at and rank == 1:
                os.kill(os.getpid(), signal.SIGUSR1)
            return step_row(step, *args, **kwargs)

        metrics.step_row = signalling_step_row
    elif fault.startswith(("EDQUOT-", "EFBIG-")) and rank == 0:
        # EDQUOT-metrics-at-N: the N-th metrics row gets half-way, then the quota is exceeded;
        # EFBIG-log-at-N: the N-th line of the log (standard output) meets the file-size limit
        import errno

        code, where, _, n = fault.split("-")
        refusal = OSError(getattr(errno, code), os.strerror(getattr(errno, code)))
        calls = [0]
        if where == "metrics":
            from boostmpi import files

            write_all = files._write_all

            def refusing_write_all(fd, data):
                calls[0] += 1
                if calls[0] == int(n):
                    write_all(fd, data[: len(data) // 2])
                    raise refusal
                write_all(fd, data)

            files._write_all = refusing_write_all
        else:
            import builtins

            from boostmpi.train import trainer

            def refusing_print(*args, **kwargs):
                if kwargs.get("file") is not sys.stderr:
                    calls[0] += 1
                    if calls[0] == int(n):
                        raise refusal
                builtins.print(*args, **kwargs)

            trainer.print = refusing_print
    from boostmpi.cli import main

    sys.exit(main(sys.argv[1:]))
''')

WATCHDOG_SCRIPT = textwrap.dedent('''
    """Rank 1 never joins the second all-reduce; rank 0's watchdog must end the job."""
    import sys
    import time

    import numpy as np
    from mpi4py import MPI

    from boostmpi.parallel.comm import CommCounter, Group, configure_watchdog

    configure_watchdog(float(sys.argv[1]))
    group = Group("tp", MPI.COMM_WORLD.Dup(), CommCounter())
    buf = np.ones(8)
    group.allreduce(buf)
    assert buf[0] == 2.0
    if group.rank == 1:
        time.sleep(60)  # stuck outside MPI
    group.allreduce(buf)
''')


def _env(**extra):
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    env.update(extra)
    return env


def _train_argv(run_dir, program=("-m", "boostmpi"), steps=STEPS):
    return ["timeout", str(JOB_TIMEOUT_S), MPIEXEC, "-n", str(RANKS), PY, *program, "train",
            "--config", "configs/tiny.toml", "--set", "parallel.tp=2", "--set", "parallel.dp=2",
            "--set", f"train.run_dir={run_dir}", "--set", f"train.steps={steps}", "--set", f"checkpoint.every={EVERY}"]


def _run(argv, **env):
    """(exit status, output, seconds) of a command that must end by itself."""
    t0 = time.monotonic()
    p = subprocess.run(argv, cwd=REPO, env=_env(**env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, timeout=JOB_TIMEOUT_S + 30)
    return p.returncode, p.stdout, time.monotonic() - t0


def _start(argv, log, **env):
    return subprocess.Popen(argv, cwd=REPO, env=_env(**env), stdout=open(log, "w"), stderr=subprocess.STDOUT)


def _losses(run_dir):
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl") if line.strip()]
    return [(r["step"], r["loss"]) for r in rows]


def _wait_for_rows(run_dir, n, proc):
    path = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the job ended (status {proc.returncode}) before it wrote {n} steps")
        if path.exists() and sum(1 for line in open(path) if line.strip()) >= n:
            return
        time.sleep(0.01)
    pytest.fail(f"no {n} steps in {path} after {JOB_TIMEOUT_S} s")


def _children():
    """{parent pid: [child pids]} of every process (through /proc)."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    return children


def _rank_pids(root_pid):
    """{MPI rank: pid} of the ranks started under `root_pid` (found through /proc, by PMI_RANK)."""
    children = _children()
    ranks, todo = {}, [root_pid]
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        rank = next((v[len(b"PMI_RANK="):] for v in environ if v.startswith(b"PMI_RANK=")), None)
        if rank is not None and pid != root_pid:
            ranks[int(rank)] = pid
    return ranks


def _alive(pid):
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wait_ranks(proc, n=RANKS):
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        ranks = _rank_pids(proc.pid)
        if len(ranks) == n:
            return ranks
        time.sleep(0.05)
    pytest.fail(f"did not find {n} rank processes under pid {proc.pid}")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The losses of an uninterrupted run."""
    run_dir = tmp_path_factory.mktemp("faults") / "reference"
    status, out, _ = _run(_train_argv(run_dir))
    assert status == 0, out
    losses = _losses(run_dir)
    assert [s for s, _ in losses] == list(range(1, STEPS + 1))
    return losses


def test_kill_9_of_one_rank_ends_all_and_the_restart_continues_exactly(tmp_path, reference):
    run_dir = tmp_path / "run"
    gate = tmp_path / "gate"
    gate.touch()  # the first run waits before step 26 while it exists (one batch per step here), so
    # however slow the machine, it is alive and holds the run directory while the second run is refused
    proc = _start(_train_argv(run_dir, program=("-c", FAULT_LAUNCHER)), tmp_path / "first.log",
                  BOOSTMPI_FAULT="hold-before-batch-26", BOOSTMPI_FAULT_GATE=str(gate))
    try:
        ranks = _wait_ranks(proc)
        _wait_for_rows(run_dir, 25, proc)
        # a second run on the live run directory (any layout) is refused in one line naming the holder
        first = _train_argv(run_dir)
        status, out, _ = _run(["timeout", str(JOB_TIMEOUT_S), PY, "-m", "boostmpi", *first[first.index("train"):],
                               "--set", "parallel.tp=1", "--set", "parallel.dp=1"])
        lines = [line for line in out.splitlines() if line.strip() and not line.startswith(("mpi:", "boostmpi |"))]
        assert status == 2 and len(lines) == 1, out
        assert lines[0].startswith(f"error: train.run_dir {run_dir} is in use by another run (host "), lines[0]
        assert f"pid {ranks[0]}, started " in lines[0], lines[0]
        gate.unlink()
        _wait_for_rows(run_dir, 35, proc)
        killed_at = time.monotonic()
        os.kill(ranks[1], signal.SIGKILL)
        proc.wait(timeout=60)
        ended_in = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            proc.kill()
    log = (tmp_path / "first.log").read_text()
    assert proc.returncode != 0, log
    assert ended_in < 30, f"the job took {ended_in:.1f} s to end after one rank was killed"
    assert not any(_alive(pid) for pid in ranks.values()), "a rank outlived the job"
    assert "done: step" not in log

    from boostmpi.checkpoint import find_latest

    latest = find_latest(str(run_dir))
    assert latest is not None
    resumed_step = int(Path(latest).name.split("_")[1])
    assert 0 < resumed_step < STEPS

    stale = (run_dir / ".lock").exists()  # rank 0 was ended by the launcher before it could release it
    status, out, _ = _run(_train_argv(run_dir))
    assert status == 0, out
    assert f"resumed from {latest} (step {resumed_step})" in out
    assert (f"the lock of {run_dir} was stale (host " in out) == stale, out
    assert _losses(run_dir) == reference  # exactly: same steps, bit-identical losses, in step order
    assert not (run_dir / ".lock").exists()


@pytest.mark.parametrize("fault,left", [("kill-while-saving-step-", "model.h5"),
                                        ("kill-rank-1-while-saving-step-", "rank-tp1-pp0-dp0.h5")])
def test_kill_during_checkpoint_writing_keeps_the_previous_checkpoint(fault, left, tmp_path, reference):
    from boostmpi.errors import CheckpointError
    from boostmpi import checkpoint

    run_dir = tmp_path / "run"
    kill_step = 3 * EVERY
    status, out, seconds = _run(_train_argv(run_dir, program=("-c", FAULT_LAUNCHER)),
                                BOOSTMPI_FAULT=f"{fault}{kill_step}")
    assert status != 0, out
    assert seconds < 30, out

    root = run_dir / "checkpoints"
    partial = [p for p in root.iterdir() if p.name.startswith(f".step_{kill_step:08d}.tmp")]
    assert len(partial) == 1 and (partial[0] / left).exists(), sorted(os.listdir(root))
    assert not (partial[0] / checkpoint.MARKER).exists()
    with pytest.raises(CheckpointError, match="incomplete"):
        checkpoint.resolve(str(partial[0]))
    previous = root / f"step_{kill_step - EVERY:08d}"
    assert (root / "latest").read_text().strip() == previous.name
    assert checkpoint.find_latest(str(run_dir)) == str(previous)
    checkpoint.verify(str(previous))  # loadable: every file matches its recorded SHA-256

    status, out, _ = _run(_train_argv(run_dir))
    assert status == 0, out
    assert f"resumed from {previous} (step {kill_step - EVERY})" in out
    # the killed writer's temporary folder is removed at the start, saying so
    assert f"removed {partial[0]}, left by a writer that stopped before finishing it" in out
    assert not partial[0].exists()
    assert _losses(run_dir) == reference


def _launcher_pid(timeout_pid):
    """The mpiexec started by `timeout` (its child)."""
    children = _children().get(timeout_pid)
    if not children:
        pytest.fail(f"no child of pid {timeout_pid}")
    return children[0]


@pytest.mark.parametrize("how", ["sigterm-to-every-rank", "ctrl-c-to-mpiexec"])
def test_a_stop_signal_writes_a_checkpoint_exits_75_and_the_rerun_resumes(how, tmp_path, reference):
    """SIGTERM to every task, as Slurm does at a time limit, or SIGINT to a plain mpiexec, as Ctrl-C
    in its terminal does (Hydra forwards it to the ranks): one line, a checkpoint, exit status 75."""
    run_dir = tmp_path / "run"
    proc = _start(_train_argv(run_dir), tmp_path / "first.log")
    try:
        ranks = _wait_ranks(proc)
        _wait_for_rows(run_dir, 15, proc)
        if how == "ctrl-c-to-mpiexec":
            os.kill(_launcher_pid(proc.pid), signal.SIGINT)
        else:
            for pid in ranks.values():
                os.kill(pid, signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    log = (tmp_path / "first.log").read_text()
    assert proc.returncode == 75, log
    assert log.count("stopped by signal at step") == 1, log
    assert "Traceback" not in log and "KeyboardInterrupt" not in log and "done: step" not in log, log
    name = "SIGINT" if how == "ctrl-c-to-mpiexec" else "SIGTERM"
    assert f"resume by running the same command ({name}; exit status 75)" in log, log
    stopped = int(log.split("stopped by signal at step ")[1].split(":")[0])
    assert 15 <= stopped < STEPS

    from boostmpi.checkpoint import find_latest

    latest = find_latest(str(run_dir))
    assert latest == str(run_dir / "checkpoints" / f"step_{stopped:08d}")
    if how == "ctrl-c-to-mpiexec":
        return  # the same checkpoint either way: resuming it is checked once, below

    status, out, _ = _run(_train_argv(run_dir))
    assert status == 0, out
    assert f"resumed from {latest} (step {stopped})" in out
    assert _losses(run_dir) == reference


@pytest.mark.parametrize("damage", ["truncate", "flip-a-bit"])
def test_a_damaged_model_h5_is_refused_naming_the_file(tmp_path, reference, damage):
    run_dir = tmp_path / "run"
    status, out, _ = _run(_train_argv(run_dir, steps=EVERY))
    assert status == 0, out
    model = run_dir / "checkpoints" / f"step_{EVERY:08d}" / "model.h5"
    data = bytearray(model.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 2] ^= 0x10
    model.write_bytes(bytes(data))

    status, out, seconds = _run(_train_argv(run_dir, steps=2 * EVERY))
    assert status == 2, out
    assert str(model) in out
    assert ("truncated" if damage == "truncate" else "corrupted") in out
    assert "Traceback" not in out
    assert seconds < 30


def test_an_exception_on_one_rank_ends_every_rank_quickly(tmp_path):
    status, out, seconds = _run(_train_argv(tmp_path / "run", program=("-c", FAULT_LAUNCHER)),
                                BOOSTMPI_FAULT="raise-on-rank-2")
    assert status == 1, out
    assert "rank 2: unhandled RuntimeError: injected failure" in out
    assert "Traceback (most recent call last)" in out
    assert seconds < 20, f"the job took {seconds:.1f} s to end"


def test_the_watchdog_ends_a_collective_that_a_peer_never_joins():
    status, out, seconds = _run(["timeout", "60", MPIEXEC, "-n", "2", PY, "-c", WATCHDOG_SCRIPT, "1.0"])
    assert status != 0 and status != 124, out  # ended by the watchdog, not by `timeout`
    assert "watchdog: rank 0: Allreduce of 64 bytes on the tp axis has waited" in out, out
    assert "parallel.watchdog_s = 1" in out
    assert "is waiting in:" in out and ", in allreduce" in out  # the stack of the waiting rank
    assert seconds < 20


# ---------------------------------------------------------------- a full disk while checkpointing

@pytest.fixture(scope="module")
def text_shards(tmp_path_factory):
    from tests.support.train_helpers import write_text_shards

    return write_text_shards(tmp_path_factory.mktemp("text"), max_bytes=60_000)


def _checkpoint_folder_state(run_dir):
    from tests.support.train_helpers import file_digests

    root = run_dir / "checkpoints"
    return sorted(os.listdir(root)), file_digests(root)


def _assert_disk_full_refusal(status, err, run_dir, before, *fragments):
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: cannot write checkpoint step_00000004 into "), err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    # the previous checkpoint and `latest` untouched, and no temporary folder left behind
    assert _checkpoint_folder_state(run_dir) == before
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000002"


@pytest.mark.parametrize("where", ["rank file", "model.h5"])
def test_a_write_that_hits_a_full_disk_removes_its_temporary_folder(where, text_shards, tmp_path, capfd, monkeypatch):
    import errno

    from boostmpi.checkpoint import writer as checkpoint_writer  # where the save looks its writers up
    from tests.support.train_helpers import run_train, stop_signals_restored

    run_dir = tmp_path / "run"
    assert run_train(run_dir, *text_shards, "train.steps=2") == 0
    before = _checkpoint_folder_state(run_dir)
    writer = "write_rank_file" if where == "rank file" else "write_virtual_files"
    write = getattr(checkpoint_writer, writer)

    def write_until_full(path, *args, **kwargs):
        target = path if where == "rank file" else os.path.join(path, "model.h5")
        open(target, "wb").write(b"\0" * 1000)  # part of the file is written, then the disk is full
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), target)

    assert write is not None
    monkeypatch.setattr(checkpoint_writer, writer, write_until_full)
    capfd.readouterr()
    with stop_signals_restored():
        status = run_train(run_dir, *text_shards, "train.steps=4")
    _assert_disk_full_refusal(status, capfd.readouterr().err, run_dir, before, "no space left on device", "it needs ")


def test_too_little_free_space_is_refused_before_writing(text_shards, tmp_path, capfd, monkeypatch):
    from boostmpi import files
    from tests.support.train_helpers import run_train

    run_dir = tmp_path / "run"
    assert run_train(run_dir, *text_shards, "train.steps=2") == 0
    before = _checkpoint_folder_state(run_dir)
    monkeypatch.setattr(files, "free_bytes", lambda path: 4096)
    capfd.readouterr()
    status = run_train(run_dir, *text_shards, "train.steps=4")
    _assert_disk_full_refusal(status, capfd.readouterr().err, run_dir, before,
                              "no space left on device; it needs ", "iB, 4.0 KiB free")


def test_a_first_checkpoint_that_cannot_be_written_claims_no_previous_one(text_shards, tmp_path, capfd, monkeypatch):
    """No room at the first save: the line says there is nothing to resume from (not that a previous
    checkpoint is unchanged), and the rerun says why it cannot resume."""
    from boostmpi import files
    from tests.support.train_helpers import run_train

    run_dir = tmp_path / "run"
    monkeypatch.setattr(files, "free_bytes", lambda path: 4096)
    capfd.readouterr()
    assert run_train(run_dir, *text_shards, "train.steps=2") == 2
    lines = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and "nothing was written, there is no earlier checkpoint" in lines[0], lines
    assert "previous checkpoint" not in lines[0]
    monkeypatch.undo()
    assert run_train(run_dir, *text_shards, "train.steps=2") == 2
    lines = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and "(its first checkpoint was never written)" in lines[0], lines


def test_a_file_size_limit_under_mpiexec_ends_every_rank_with_one_line(text_shards, tmp_path):
    """`ulimit -f` below the size of optim.h5 (MPI itself needs about 10 MB of shared-memory files,
    so the model is made big enough that its optimizer state is not): HDF5 would crash on the
    failed write; the check before writing refuses it instead, on every rank."""
    from tests.support.train_helpers import run_train, train_argv

    model = ["model.arch=full", "model.d_model=256", "model.d_ff=1024"]  # optim.h5 about 17 MB, model.h5 8 MB
    run_dir = tmp_path / "run"
    assert run_train(run_dir, *text_shards, "train.steps=2", *model) == 0
    before = _checkpoint_folder_state(run_dir)
    argv = train_argv(run_dir, *text_shards, "train.steps=4", "parallel.tp=2", "parallel.tp_mode=vanilla", *model)
    command = " ".join(["ulimit -f 12000 &&", "exec timeout", str(JOB_TIMEOUT_S), MPIEXEC, "-n", "2", PY, "-m", "boostmpi",
                        *(f"'{a}'" for a in argv)])
    p = subprocess.run(["bash", "-c", command], cwd=REPO, env=_env(), capture_output=True, text=True,
                       timeout=JOB_TIMEOUT_S + 30)
    assert "Traceback" not in p.stderr and "Segmentation" not in p.stderr, p.stderr
    _assert_disk_full_refusal(p.returncode, p.stderr, run_dir, before, "file-size limit", "(ulimit -f)")


def test_a_really_full_disk_under_mpiexec_ends_every_rank_with_one_line(text_shards, tmp_path):
    """The run directory on a small tmpfs of its own, with room for less than one more checkpoint."""
    import hashlib

    from tests.support.train_helpers import run_on_a_private_tmpfs, run_train, train_argv

    source = tmp_path / "source"
    assert run_train(source, *text_shards, "train.steps=2") == 0
    previous = source / "checkpoints" / "step_00000002"
    used = sum(p.stat().st_size for p in source.rglob("*") if p.is_file())
    checkpoint = sum(p.stat().st_size for p in previous.iterdir())
    mount = tmp_path / "disk"
    mount.mkdir()
    run_dir = mount / "run"
    argv = " ".join(f"'{a}'" for a in train_argv(run_dir, *text_shards, "train.steps=4", "parallel.tp=2"))
    script = (f"cp -a {source} {run_dir} && "
              f"{{ timeout {JOB_TIMEOUT_S} {MPIEXEC} -n 2 {PY} -m boostmpi {argv} >/dev/null; echo \"status $?\" >&3; }} "
              f"3>&1 2>&1 1>/dev/null | cat; ls -A {run_dir / 'checkpoints'}; cat {run_dir / 'checkpoints' / 'latest'}; "
              f"cd {run_dir / 'checkpoints'} && sha256sum step_00000002/*")
    # room for what is there and a little more, but not for a second checkpoint
    done = run_on_a_private_tmpfs(mount, f"size={(used + checkpoint // 2) // 4096 * 4 + 16}k", script, env=_env())
    lines = done.stdout.splitlines()
    errors = [line for line in lines if not line.startswith(("status", "step_", "latest")) and "  step_" not in line]
    assert f"status 2" in lines, done.stdout + done.stderr
    assert len(errors) == 1 and errors[0].startswith("error: cannot write checkpoint step_00000004 into "), lines
    assert "no space left on device; it needs " in errors[0] and " free; nothing was written" in errors[0], errors[0]
    assert [line for line in lines if line.startswith(("step_", "latest"))] == ["latest", "step_00000002", "step_00000002"]
    digests = {f"step_00000002/{p.name}": hashlib.sha256(p.read_bytes()).hexdigest() for p in previous.iterdir()}
    assert {line.split()[1]: line.split()[0] for line in lines if "  step_" in line} == digests


# ---------------------------------------------------------------- one run per run directory

HOLD_LOCK = textwrap.dedent('''
    import sys, time
    from boostmpi.files import RunLock

    lock = RunLock(sys.argv[1]).acquire()  # held while this process lives
    print("held", flush=True)
    time.sleep(120)
''')


def test_the_lock_of_a_killed_holder_is_stale_and_taken_over(tmp_path):
    """A real holder in another process: refused while it lives, taken over (saying so) once it is
    killed with SIGKILL, and released (the file removed) by the new holder."""
    from boostmpi.files import RunDirInUse, RunLock

    holder = subprocess.Popen(["timeout", "150", PY, "-c", HOLD_LOCK, str(tmp_path)], cwd=REPO, env=_env(),
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        pid = _children()[holder.pid][0]
        with pytest.raises(RunDirInUse, match=rf"in use by another run \(host \S+, pid {pid}, started 20\d\d-"):
            RunLock(tmp_path).acquire()
        os.kill(pid, signal.SIGKILL)
        holder.wait(timeout=30)
    finally:
        if holder.poll() is None:
            holder.kill()
    lock = RunLock(tmp_path).acquire()
    assert lock.stale is not None and f"pid {pid}" in lock.stale
    with pytest.raises(RunDirInUse):  # another open of the file, even in this process, is refused
        RunLock(tmp_path).acquire()
    lock.release()
    assert not (tmp_path / ".lock").exists()
    RunLock(tmp_path).acquire().release()  # a clean release leaves nothing stale behind


@pytest.mark.parametrize("holder,age_s,refused", [
    ("this host, live pid", 0, True), ("this host, dead pid", 0, False),
    ("another host, lease renewed", 10, True), ("another host, lease expired", 1000, False)])
def test_without_os_locks_the_record_is_a_lease(holder, age_s, refused, tmp_path, monkeypatch):
    """A filesystem that refuses flock (ENOLCK): the holder record decides, by pid on the same host
    and by the age of the lease (the file's mtime, renewed by the holder) from another host."""
    import errno
    import fcntl
    import json
    import socket

    from boostmpi import files

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    dead = subprocess.run([PY, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout.strip()
    host = socket.gethostname() if holder.startswith("this") else "elsewhere-node-7"
    pid = os.getpid() if "live" in holder else int(dead)
    record = tmp_path / ".lock"
    record.write_text(json.dumps({"host": host, "pid": pid, "started": "2026-01-01 00:00:00 UTC"}))
    os.utime(record, (time.time() - age_s, time.time() - age_s))
    if refused:
        with pytest.raises(files.RunDirInUse, match=f"host {host}, pid {pid}, started 2026-01-01"):
            files.RunLock(tmp_path).acquire()
        return
    lock = files.RunLock(tmp_path).acquire()
    assert lock.stale == f"host {host}, pid {pid}, started 2026-01-01 00:00:00 UTC"
    assert json.loads(record.read_text())["pid"] == os.getpid()
    lock.release()
    assert not record.exists()


# ---------------------------------------------------------------- a disk that fills up during training

def test_a_disk_filled_during_training_ends_the_job_in_one_line_and_every_writer_refuses_it(text_shards, tmp_path):
    """A real tmpfs of 8 MiB of its own: 2 ranks train, and once the first checkpoint is there the
    rest of the disk is filled. The metrics append (or, if the filler is late, the next checkpoint)
    fails on rank 0: one line, exit 2 for the whole
    job, metrics.jsonl ends with its last whole row, and the checkpoint evaluates. Then `export`
    (two formats), `plot` and `data` on the full disk: one line and exit 2 each."""
    from tests.support.train_helpers import run_on_a_private_tmpfs, train_argv

    mount, logs = tmp_path / "disk", tmp_path / "logs"
    mount.mkdir(), logs.mkdir()
    run_dir = mount / "run"
    argv = " ".join(f"'{a}'" for a in train_argv(run_dir, *text_shards, "train.steps=3000", "checkpoint.every=20",
                                                  "train.log_every=1", "parallel.tp=2"))
    boostmpi = f"timeout {JOB_TIMEOUT_S} {PY} -m boostmpi"

    def step(name, command):  # run `command`, its stderr and exit status into logs/name.*
        return f"{command} >{logs}/{name}.out 2>{logs}/{name}.err; echo $? >{logs}/{name}.status; "

    script = (f"( {step('train', f'timeout {JOB_TIMEOUT_S} {MPIEXEC} -n 2 {PY} -m boostmpi {argv}')} ) & "
              f"while [ ! -e {run_dir}/checkpoints/latest ] && [ ! -e {logs}/train.status ]; do sleep 0.05; done; "
              f"dd if=/dev/zero of={mount}/filler bs=64k 2>/dev/null; wait; "
              f"rm -f {mount}/filler; dd if=/dev/zero of={mount}/filler bs=64k 2>/dev/null; "  # nothing freed since
              + step("export-safetensors", f"{boostmpi} export {run_dir} --to safetensors --out {mount}/w.safetensors")
              + step("export-h5", f"{boostmpi} export {run_dir} --to h5 --out {mount}/w.h5")
              + step("plot", f"{boostmpi} plot {run_dir} --out {mount}/curves.png")
              + step("data", f"{boostmpi} data --builtin --max-bytes 3000000 --out {mount}/data")
              + f"cp -a {run_dir} {tmp_path}/saved")
    done = run_on_a_private_tmpfs(mount, "size=8m", script, env=_env(), timeout=JOB_TIMEOUT_S * 3)
    assert done.returncode == 0, done.stdout + done.stderr
    # Which write meets the full disk first is a race: the metrics append after the filler ran, or,
    # when the filler starts late on a loaded machine, the next checkpoint's free-space check (the
    # checkpoints themselves fill the 8 MiB). Either way it is one line and exit status 2.
    train_lines = (f"error: cannot append to {run_dir}/metrics.jsonl: no space left on device",
                   f"error: cannot write checkpoint step_")
    for name, fragment in [("train", train_lines),
                           ("export-safetensors", f"error: cannot write {mount}/w.safetensors: no space left on device"),
                           ("export-h5", f"error: cannot write {mount}/w.h5: no space left on device"),
                           ("plot", f"error: cannot write {mount}/curves.png: no space left on device"),
                           ("data", f"error: cannot write {mount}/data")]:
        err = (logs / f"{name}.err").read_text()
        lines = [line for line in err.splitlines() if line.strip()]
        assert (logs / f"{name}.status").read_text().strip() == "2", (name, err)
        assert len(lines) == 1 and lines[0].startswith(fragment), (name, err)
        assert "no space left on device" in lines[0], (name, err)
    saved = tmp_path / "saved"
    assert not (saved / ".lock").exists()
    rows = [json.loads(line) for line in open(saved / "metrics.jsonl")]  # every row whole
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1)) and len(rows) < 3000
    from boostmpi.cli import main

    assert main(["eval", str(saved), "--data", str(text_shards[1]), "--max-windows", "4"]) == 0


@pytest.mark.parametrize("fault,line", [
    ("EDQUOT-metrics-at-25", "cannot append to {run_dir}/metrics.jsonl: the disk quota is exceeded"),
    ("EFBIG-log-at-25", "cannot write the log (standard output) <stdout>: the file-size limit was reached (ulimit -f)")])
def test_a_quota_or_file_size_limit_on_rank_0_ends_every_rank_with_one_line(fault, line, tmp_path):
    """Injected on rank 0 alone (the fault launcher): the job ends with one line and exit status 2 on
    every rank at the next step, no traceback; metrics.jsonl ends with its last whole row, in step
    order; the last checkpoint is intact."""
    from boostmpi import checkpoint

    run_dir = tmp_path / "run"
    status, out, seconds = _run(_train_argv(run_dir, program=("-c", FAULT_LAUNCHER), steps=60),
                                BOOSTMPI_FAULT=fault)
    errors = [x for x in out.splitlines() if "error" in x.lower() or "Traceback" in x or "MPI_Abort" in x]
    assert status == 2, out
    assert errors == ["error: " + line.format(run_dir=run_dir)], out
    steps = [s for s, _ in _losses(run_dir)]
    assert steps == list(range(1, len(steps) + 1)) and 20 <= len(steps) <= 25, steps
    latest = checkpoint.find_latest(str(run_dir))
    assert latest == str(run_dir / "checkpoints" / "step_00000020")
    checkpoint.verify(latest)
    assert seconds < 30


# ---------------------------------------------------------------- a peer lost during a checkpoint

NCCL_WATCHDOG_SCRIPT = textwrap.dedent('''
    """On the CuPy stand-in's NCCL: rank 1 never joins the second all-reduce of an NCCL group."""
    import sys
    import time

    import cupy
    from mpi4py import MPI

    from boostmpi.parallel.comm import CommCounter, configure_watchdog
    from boostmpi.parallel.nccl import NcclGroup, select_device

    select_device(MPI.COMM_WORLD.Get_rank())
    group = NcclGroup("dp", MPI.COMM_WORLD.Dup(), CommCounter())
    buf = cupy.ones(8, dtype=cupy.float32)
    group.allreduce(buf)
    assert float(buf.get()[0]) == 2.0
    MPI.COMM_WORLD.Barrier()
    # armed only now: on a loaded machine a 1 s limit could otherwise fire during the set-up above
    configure_watchdog(float(sys.argv[1]))
    if group.rank == 1:
        time.sleep(60)  # stuck outside NCCL
    group.allreduce(buf)
''')


def test_the_watchdog_aborts_a_stuck_nccl_group():
    env = {"PYTHONPATH": os.pathsep.join([str(REPO / "testing" / "cupy_standin"), str(REPO)]),
           "BOOSTMPI_CUPY_STANDIN": "1"}
    status, out, seconds = _run(["timeout", "60", MPIEXEC, "-n", "2", PY, "-c", NCCL_WATCHDOG_SCRIPT, "1.0"], **env)
    assert status != 0 and status != 124, out
    assert "watchdog: rank 0: NCCL allReduce on the dp axis has waited" in out, out
    assert "watchdog: rank 0: aborted 1 NCCL communicator(s) (ncclCommAbort)" in out, out
    assert seconds < 20


DEVICE_READ_SCRIPT = textwrap.dedent('''
    """The step's device read waits for device work that never finishes (an NCCL collective a peer
    never joined, as on a real GPU, where the NCCL call itself returned at once)."""
    import sys
    import time

    from boostmpi.parallel.comm import WATCHDOG, configure_watchdog
    from boostmpi.parallel.engine import read_to_host

    class Stuck:  # the stack of the loss and the squared norm, whose copy to the host never completes
        def get(self):
            time.sleep(60)

    class Device:
        def stack(self, values):
            return Stuck()

    WATCHDOG.on_fire(lambda: print("aborted the stuck communicator", flush=True) or 1)
    configure_watchdog(float(sys.argv[1]))
    read_to_host(Device(), [object(), 2.0])
''')


def test_the_watchdog_ends_a_step_stuck_at_its_device_read():
    """On a GPU the step's one synchronisation is where a stuck NCCL collective shows: it is watched,
    and the watchdog aborts the registered communicators and ends the job within the limit."""
    status, out, seconds = _run(["timeout", "60", PY, "-c", DEVICE_READ_SCRIPT, "1.0"])
    assert status != 0 and status != 124, out
    assert "watchdog: rank 0: the step's device read (every queued kernel and collective) on the device axis " \
           "has waited" in out, out
    assert "aborted the stuck communicator" in out, out
    assert seconds < 20, out


WATCHDOG_S = 3


@pytest.mark.parametrize("how", ["stop", "kill"])
def test_a_rank_stopped_or_killed_during_a_checkpoint_ends_every_rank_within_the_watchdog_limit(how, tmp_path):
    """Rank 1 gets SIGSTOP (alive, never answering) or SIGKILL once its own file of the step-30
    checkpoint is written, while the others wait in the checkpoint's agreement: every rank is gone
    within parallel.watchdog_s + 5 s, and the step-20 checkpoint is still the latest and intact."""
    from boostmpi import checkpoint

    run_dir = tmp_path / "run"
    argv = _train_argv(run_dir, program=("-c", FAULT_LAUNCHER), steps=40) + ["--set", f"parallel.watchdog_s={WATCHDOG_S}"]
    note = tmp_path / "signalled"
    status, out, _ = _run(argv, BOOSTMPI_FAULT=f"{how}-rank-1-while-saving-step-{3 * EVERY}", BOOSTMPI_FAULT_NOTE=str(note))
    ended = time.time()
    assert status != 0 and status != 124, out
    name, signalled = note.read_text().split()
    assert name == f"SIG{how.upper()}"
    assert ended - float(signalled) < WATCHDOG_S + 5, out
    if how == "stop":
        assert "watchdog: rank " in out and "on the checkpoint axis has waited" in out, out
    latest = checkpoint.find_latest(str(run_dir))
    assert latest == str(run_dir / "checkpoints" / f"step_{2 * EVERY:08d}")
    checkpoint.verify(latest)


def test_a_stop_signal_late_in_a_step_is_acted_on_at_that_step(tmp_path):
    """SIGTERM arriving during validation (after the step's all-reduce has counted the stop flags) stops
    the job with a checkpoint of that very step, not one step later."""
    run_dir = tmp_path / "run"
    argv = _train_argv(run_dir, program=("-c", FAULT_LAUNCHER), steps=40) + ["--set", "train.val_every=5"]
    status, out, _ = _run(argv, BOOSTMPI_FAULT="sigterm-in-validation-at-step-15")
    assert status == 75, out
    assert "stopped by signal at step 15: checkpoint written" in out, out
    assert [s for s, _ in _losses(run_dir)][-1] == 15


def test_a_stop_signal_on_one_rank_after_the_all_reduce_stops_at_that_step_boundary(tmp_path, reference):
    """SIGUSR1 to rank 1 alone, after step 17's merged all-reduce: the other ranks learn of it from step
    18's all-reduce, that step is dropped, and the checkpoint is of step 17; the rerun matches the
    uninterrupted run's losses exactly (the dropped step's batches went back to the data stream)."""
    run_dir = tmp_path / "run"
    status, out, _ = _run(_train_argv(run_dir, program=("-c", FAULT_LAUNCHER)),
                          BOOSTMPI_FAULT="sigusr1-on-rank-1-after-the-all-reduce-of-step-17")
    assert status == 75, out
    assert "stopped by signal at step 17: checkpoint written" in out, out
    assert [s for s, _ in _losses(run_dir)][-1] == 17
    from boostmpi.checkpoint import find_latest

    assert find_latest(str(run_dir)) == str(run_dir / "checkpoints" / f"step_{17:08d}")
    status, out, _ = _run(_train_argv(run_dir))
    assert status == 0, out
    assert _losses(run_dir) == reference


def test_a_refused_metrics_row_is_cut_off_again(tmp_path, monkeypatch):
    """Half a row reaches the disk, then the quota refuses the rest: the file is cut back to its last whole
    row. The mutant that does not cut back leaves the half row, and this check sees it."""
    import errno

    from boostmpi import files

    path = tmp_path / "metrics.jsonl"

    def half_then_refuse(fd, data):
        os.write(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))

    def append_refused():
        log = files.LineLog(path)
        log.append('{"step": 1}\n')
        monkeypatch.setattr(files, "_write_all", half_then_refuse)
        with pytest.raises(files.FilesystemError, match=f"cannot append to {path}: the disk quota is exceeded"):
            log.append('{"step": 2, "loss": 1.0}\n')
        log.close()
        monkeypatch.undo()
        return path.read_text()

    assert append_refused() == '{"step": 1}\n'
    path.unlink()
    monkeypatch.setattr(os, "ftruncate", lambda fd, length: None)  # the mutant
    assert append_refused() != '{"step": 1}\n'


def test_a_second_ctrl_c_stops_at_once_without_claiming_a_clean_stop(tmp_path):
    """Ctrl-C, then Ctrl-C again 2 s later while the stop's checkpoint is still being written: the job
    ends at once without it (Hydra's mpiexec forces the abort; a rank that sees the second SIGINT
    itself exits 130), nothing claims a clean stop (never status 75, no STOPPED_ON_SIGNAL marker, no
    DONE), no rank outlives it, and the previous checkpoint stays the latest and intact. mpiexec's own
    status after its forced abort is Hydra's: MPICH 5.0.2 returned 255 in some runs and 0 in others
    (its proxy fails an assertion while cleaning up), so the run directory, not that status, is
    what tells a script the run did not finish."""
    from boostmpi import checkpoint

    run_dir = tmp_path / "run"
    proc = _start(_train_argv(run_dir, program=("-c", FAULT_LAUNCHER)), tmp_path / "log", BOOSTMPI_FAULT="slow-stop-save")
    try:
        ranks = _wait_ranks(proc)
        _wait_for_rows(run_dir, 15, proc)
        launcher = _launcher_pid(proc.pid)
        os.kill(launcher, signal.SIGINT)
        time.sleep(2)
        os.kill(launcher, signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    log = (tmp_path / "log").read_text()
    assert proc.returncode != 75, log
    assert not (run_dir / "STOPPED_ON_SIGNAL").exists() and not (run_dir / "DONE").exists(), log
    assert "stopped by signal" not in log and "done: step" not in log, log
    deadline = time.monotonic() + 5  # the launcher's SIGKILLs may land just after it exits
    while any(_alive(pid) for pid in ranks.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = {rank: Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[:2]
             for rank, pid in ranks.items() if _alive(pid)}
    assert not alive, f"ranks outlived the job (state, parent): {alive}\n{log}"
    latest = checkpoint.find_latest(str(run_dir))
    assert latest is not None and int(Path(latest).name.split("_")[1]) % EVERY == 0
    checkpoint.verify(latest)
