"""Start-up checks (boostmpi/parallel/startup.py): the MPI report and the refusal of the PyPI MPICH
in a multi-node batch job, the GPU-per-rank check with faked PCI bus ids (no GPU here), and the
NCCL availability decision on a fake `cupy.cuda.nccl`.

Single-process and under MPI (`mpiexec -n N python -m pytest --with-mpi -m mpi`): the collective
checks run on every rank with per-rank fake bus ids.
"""

import io
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from boostmpi.errors import UserError
from boostmpi.parallel import startup
from boostmpi.sim.model import memory_estimate
from tests.support.mpi_helpers import collectively, world

REPO = Path(__file__).resolve().parents[3]
CRAY = "MPI VERSION    : CRAY MPICH version 8.1.28.2 (ANL base 3.4a2)\nMPI BUILD INFO : Wed Nov 15 2023\n"
MPICH = "MPICH Version:\t4.0.2\nMPICH Release date:\tThu Apr  7 2022\nMPICH ABI:\t14:2:2\nMPICH Device:\tch4:ucx\n"


# ---------------------------------------------------------------- MPI library, transport, site MPI

def test_transport_is_read_from_the_library_version_and_the_choosing_variables():
    assert startup.transport(MPICH, {}) == "ch4:ucx"
    assert startup.transport(MPICH, {"UCX_TLS": "shm,tcp"}) == "ch4:ucx (UCX_TLS=shm,tcp)"
    assert startup.transport(CRAY, {"FI_PROVIDER": "cxi"}).startswith("ofi (Cray MPICH over libfabric")
    assert startup.transport("Open MPI v5.0.3, package: ...", {}) == "chosen at run time by Open MPI"
    assert startup.transport("Intel(R) MPI Library 2021.6", {}) == "not reported by the library"


def test_the_loaded_mpi_library_is_found_in_the_process_map(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libmpichfort.so.12\n"
                    "7f01-7f02 r-xp 0 08:01 2 /opt/cray/pe/mpich/8.1.28/ofi/gnu/12.3/lib/libmpi_gnu_123.so.12.0.0\n"
                    "7f02-7f03 r-xp 0 08:01 3 /venv/lib/python3.11/site-packages/mpi4py/MPI.cpython-311.so\n"
                    "7f03-7f04 rw-p 0 00:00 0 [heap]\n")
    assert startup.loaded_mpi_library(str(maps)) == "/opt/cray/pe/mpich/8.1.28/ofi/gnu/12.3/lib/libmpi_gnu_123.so.12.0.0"
    assert startup.loaded_mpi_library(str(tmp_path / "absent")) is None


def test_this_process_knows_whether_its_mpi_is_the_pypi_wheel():
    from mpi4py import MPI  # noqa: F401 - loads the MPI library

    library = startup.loaded_mpi_library()
    assert library is not None and os.path.exists(library)
    wheel = startup.pypi_mpich_libraries()
    # tests/run.sh's venv has the [mpich] extra, and mpi4py loads that wheel's MPICH; the
    # system-MPI venv has no wheel and loads Debian's
    assert startup.is_pypi_mpich(library, wheel) == bool(wheel), (library, sorted(wheel))
    assert startup.is_pypi_mpich(None, {"/x/libmpi.so.12"}) and not startup.is_pypi_mpich(None, set())
    assert not startup.is_pypi_mpich("/usr/lib/libmpich.so.12", {"/venv/lib/libmpi.so.12"})


@pytest.mark.parametrize("nodes, system, pypi, env, refused", [
    (2, "Slurm", True, {}, True),
    (4, "PBS", True, {}, True),
    (2, "Slurm", True, {"BOOSTMPI_ALLOW_PYPI_MPI": "1"}, False),
    (1, "Slurm", True, {}, False),      # one node: shared memory, the wheel is fine
    (2, None, True, {}, False),         # no batch system: a workstation's own cluster
    (2, "PBS", False, {}, False),       # the site's MPI
])
def test_a_multinode_batch_job_on_the_pypi_mpich_is_refused(nodes, system, pypi, env, refused):
    problem = startup.site_mpi_problem(nodes, system, pypi, env)
    assert (problem is not None) == refused
    if refused:
        assert f"{nodes}-node {system} job runs on the MPICH wheel from PyPI" in problem
        assert "BOOSTMPI_ALLOW_PYPI_MPI=1" in problem and "\n" not in problem


def test_the_batch_system_and_the_launcher_task_count_come_from_the_environment():
    assert startup.scheduler({"SLURM_JOB_ID": "7"}) == "Slurm"
    assert startup.scheduler({"PBS_JOBID": "7.polaris"}) == "PBS"
    assert startup.scheduler({}) is None
    assert startup.launcher_task_count({"SLURM_STEP_NUM_TASKS": "8"}) == 8
    assert startup.launcher_task_count({"PMI_SIZE": "4"}) == 4
    assert startup.launcher_task_count({}) is None


def _train_args(tmp_path, *sets):
    args = ["train", "--config", str(REPO / "configs" / "tiny.toml"), "--set", f"train.run_dir={tmp_path / 'run'}",
            "--set", "train.steps=2", "--set", "checkpoint.every=0"]
    for kv in sets:
        args += ["--set", kv]
    return args


@pytest.mark.mpi_skip  # one process pretending to be part of a 2-node job
def test_train_refuses_a_two_node_slurm_job_on_the_pypi_mpich(tmp_path, monkeypatch, capsys):
    """The wiring through `boostmpi train`: this machine has one node, so the node count is faked."""
    from boostmpi.cli import main

    monkeypatch.setattr(startup, "count_nodes", lambda world, local_rank: 2)
    monkeypatch.setattr(startup, "pypi_mpich_libraries", lambda: {"/the/wheel/libmpi.so.12"})
    monkeypatch.setattr(startup, "loaded_mpi_library", lambda: "/the/wheel/libmpi.so.12")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.delenv("BOOSTMPI_ALLOW_PYPI_MPI", raising=False)
    assert main(_train_args(tmp_path)) == 2
    out, err = capsys.readouterr()
    assert "(PyPI wheel)" in out and "on 2 node(s)" in out
    assert "error: this 2-node Slurm job runs on the MPICH wheel from PyPI" in err
    assert not (tmp_path / "run").exists()  # refused before any training work

    monkeypatch.setenv("BOOSTMPI_ALLOW_PYPI_MPI", "1")
    assert main(_train_args(tmp_path)) == 0
    assert (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.mpi_skip  # it starts a process of its own
def test_ranks_that_each_see_a_world_of_one_are_refused(tmp_path):
    env = dict(os.environ, SLURM_STEP_NUM_TASKS="2", PYTHONPATH=str(REPO), OPENBLAS_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-m", "boostmpi", *_train_args(tmp_path)], env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert "error: the launcher started 2 tasks but MPI sees a world of 1 rank" in p.stderr
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------- one GPU per rank (faked bus ids)

def test_gpu_mapping_problems():
    ok = [("n1", 0, "0000:07:00.0", "", True), ("n1", 1, "0000:46:00.0", "", True),
          ("n2", 2, "0000:07:00.0", "", True)]  # the same bus id on another node is another GPU
    assert startup.gpu_mapping_problem(ok) is None
    shared = ok + [("n2", 3, "0000:07:00.0", "", True)]
    assert startup.gpu_mapping_problem(shared).startswith("ranks 2, 3 on node n2 share the GPU at PCI bus 0000:07:00.0")
    unset = [("n1", 0, "0000:07:00.0", "PMI_LOCAL_RANK", True), ("n1", 1, "0000:46:00.0", "PMI_LOCAL_RANK", False)]
    assert startup.gpu_mapping_problem(unset).startswith("PMI_LOCAL_RANK is not set on rank(s) 1")


def _fake_bus(rank, distinct):
    return f"0000:{(rank if distinct else 7):02x}:00.0"


@pytest.mark.mpi
def test_every_rank_checks_the_gathered_bus_ids_together():
    comm = world()
    rank, size = comm.Get_rank(), comm.Get_size()
    out = io.StringIO()
    collectively(startup.check_gpu_per_rank, comm, rank, _fake_bus(rank, True), {}, out)
    if rank == 0:
        assert out.getvalue().startswith("gpus: one per rank") and _fake_bus(size - 1, True) in out.getvalue()

    def shared():
        with pytest.raises(UserError) as caught:
            startup.check_gpu_per_rank(comm, rank, _fake_bus(rank, False), {}, io.StringIO())
        return str(caught.value)

    if size > 1:  # every rank raises the same verdict: nobody is left in a collective
        messages = comm.allgather(collectively(shared))
        assert len(set(messages)) == 1 and "share the GPU at PCI bus 0000:07:00.0" in messages[0]

    def unset_on_odd_ranks():
        env = {"BOOSTMPI_GPU_MAP_VAR": "PMI_LOCAL_RANK", **({} if rank % 2 else {"PMI_LOCAL_RANK": str(rank)})}
        if size == 1:
            startup.check_gpu_per_rank(comm, rank, _fake_bus(rank, True), env, io.StringIO())
            return "passed"
        with pytest.raises(UserError, match=r"PMI_LOCAL_RANK is not set on rank\(s\) 1"):
            startup.check_gpu_per_rank(comm, rank, _fake_bus(rank, True), env, io.StringIO())
        return "refused"

    assert collectively(unset_on_odd_ranks) == ("passed" if size == 1 else "refused")


class _FakeDevice:
    """cupy.cuda.Device on a fake node with `count` GPUs; bus id from the device id."""

    current = None

    def __init__(self, device_id):
        self.id = device_id
        self.pci_bus_id = f"0000:{0x07 + 0x20 * device_id:02X}:00.0"

    def use(self):
        _FakeDevice.current = self.id


def _fake_cupy(monkeypatch, gpus, nccl=None):
    cupy = types.ModuleType("cupy")
    cupy.cuda = types.ModuleType("cupy.cuda")
    cupy.cuda.Device = _FakeDevice
    cupy.cuda.runtime = types.SimpleNamespace(getDeviceCount=lambda: gpus)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "cupy.cuda", cupy.cuda)
    if nccl is not None:
        cupy.cuda.nccl = nccl
        monkeypatch.setitem(sys.modules, "cupy.cuda.nccl", nccl)
    return cupy


@pytest.mark.mpi
def test_select_gpu_stops_ranks_that_see_one_gpu_each_but_share_it(monkeypatch):
    """Two ranks of a node, each shown one GPU (device 0) by a launcher that did not bind them:
    the device ids look fine, the bus ids show the sharing."""
    comm = world()
    local = comm.Split_type(__import__("mpi4py").MPI.COMM_TYPE_SHARED)
    local_rank, local_size = local.Get_rank(), local.Get_size()
    local.Free()
    _fake_cupy(monkeypatch, gpus=8)
    assert collectively(startup.select_gpu, comm, local_rank) == local_rank  # 8 GPUs: one each
    _fake_cupy(monkeypatch, gpus=1)

    def one_visible_each():
        if local_size == 1:
            return startup.select_gpu(comm, local_rank)
        with pytest.raises(UserError, match="share the GPU at PCI bus 0000:07:00.0"):
            startup.select_gpu(comm, local_rank)
        return "refused"

    assert collectively(one_visible_each) == (0 if local_size == 1 else "refused")


# ---------------------------------------------------------------- NCCL availability

def _nccl_module(available):
    nccl = types.ModuleType("cupy.cuda.nccl")
    nccl.available = available
    if available:
        nccl.NcclCommunicator = object
        nccl.get_version = lambda: 22501
    return nccl


@pytest.mark.mpi
@pytest.mark.parametrize("requested", ["auto", "nccl", "mpi"])
def test_comm_is_nccl_when_every_rank_can_load_it(monkeypatch, requested):
    _fake_cupy(monkeypatch, gpus=1, nccl=_nccl_module(True))
    out = io.StringIO()
    env = {"NCCL_NET": "AWS Libfabric", "LD_LIBRARY_PATH": ""}
    choice = collectively(startup.resolve_comm, requested, world(), env, out, io.StringIO())
    assert choice == ("mpi" if requested == "mpi" else "nccl")
    if world().Get_rank() == 0 and requested != "mpi":
        assert out.getvalue().startswith("comm: nccl 2.25.1 | NCCL_NET=AWS Libfabric | net plugin none found")


@pytest.mark.mpi
def test_auto_falls_back_to_mpi_with_a_warning_and_nccl_stops(monkeypatch):
    _fake_cupy(monkeypatch, gpus=1, nccl=_nccl_module(False))
    err = io.StringIO()
    assert collectively(startup.resolve_comm, "auto", world(), {}, io.StringIO(), err) == "mpi"
    if world().Get_rank() == 0:
        assert err.getvalue().startswith("warning: parallel.comm = \"auto\" but CuPy cannot load the NCCL library")

    def asked_for_nccl():
        with pytest.raises(UserError, match="parallel.comm = \"nccl\" but"):
            startup.resolve_comm("nccl", world(), {}, io.StringIO(), io.StringIO())

    collectively(asked_for_nccl)


def test_nccl_missing_on_one_rank_only_is_missing_for_all(monkeypatch):
    """The decision is reduced over the ranks (MAX of 'missing'): a rank that could load NCCL
    still falls back when another cannot, so all ranks use the same transport."""
    class World:
        def Get_rank(self):
            return 0

        def Allreduce(self, sendbuf, recvbuf, op):  # in place, through HostCollectives
            recvbuf[...] = 1  # another rank reports NCCL missing

    _fake_cupy(monkeypatch, gpus=1, nccl=_nccl_module(True))
    err = io.StringIO()
    assert startup.resolve_comm("auto", World(), {}, io.StringIO(), err) == "mpi"
    assert "NCCL cannot be loaded on some rank" in err.getvalue()


def test_gpu_buffers_through_cray_mpich_need_gpu_support(monkeypatch):
    from mpi4py import MPI

    _fake_cupy(monkeypatch, gpus=1, nccl=_nccl_module(False))
    monkeypatch.setattr(MPI, "Get_library_version", lambda: CRAY)
    with pytest.raises(UserError, match="MPICH_GPU_SUPPORT_ENABLED is not 1"):
        startup.resolve_comm("mpi", None, {}, io.StringIO(), io.StringIO())
    assert startup.resolve_comm("mpi", None, {"MPICH_GPU_SUPPORT_ENABLED": "1"}, io.StringIO(), io.StringIO()) == "mpi"


def test_net_plugins_are_found_on_the_library_path(tmp_path):
    (tmp_path / "librccl-net.so").write_bytes(b"")
    (tmp_path / "libother.so").write_bytes(b"")
    env = {"LD_LIBRARY_PATH": f"/nonexistent:{tmp_path}"}
    assert startup.net_plugins(env) == [str(tmp_path / "librccl-net.so")]
    assert startup.net_plugins({"NCCL_NET_PLUGIN": str(tmp_path / "librccl-net.so")}) == [str(tmp_path / "librccl-net.so")]


def test_the_banner_names_the_communication_asked_for_not_a_guess():
    """The banner is printed before the engine settles `parallel.comm`: it shows what the configuration
    asks for (the `comm:` line or a warning says what `auto` became), and `mpi` on the CPU."""
    from boostmpi.config import config_from_dict
    from boostmpi.train.cli import banner

    cpu = config_from_dict({"train": {"device": "cpu"}})
    assert " | comm mpi | " in banner(cpu, "c.toml", 1, 0)
    for comm in ("auto", "nccl", "mpi"):
        gpu = config_from_dict({"train": {"device": "gpu"}, "parallel": {"comm": comm}})
        line = banner(gpu, "c.toml", 1, 0)
        assert f" | comm {comm} | " in line and "nccl yes" not in line


# ---------------------------------------------------------------- BLAS/OpenMP threads per rank

@pytest.mark.parametrize("env,expected", [
    ({"MPI_LOCALNRANKS": "4", "PMI_RANK": "0"}, 4),  # MPICH's Hydra
    ({"OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_COMM_WORLD_SIZE": "8"}, 2),  # Open MPI
    ({"PALS_LOCAL_SIZE": "4", "PALS_RANKID": "5"}, 4),  # PALS (Polaris)
    ({"SLURM_STEP_NUM_TASKS": "9", "SLURM_STEP_TASKS_PER_NODE": "4(x2),1", "SLURM_NODEID": "2"}, 1),
    ({"SLURM_STEP_NUM_TASKS": "9", "SLURM_STEP_TASKS_PER_NODE": "4(x2),1", "SLURM_NODEID": "1"}, 4),
    ({"SLURM_STEP_NUM_TASKS": "16", "SLURM_NTASKS_PER_NODE": "8"}, 8),
    ({"SLURM_STEP_NUM_TASKS": "6", "SLURM_TASKS_PER_NODE": "3(x2)", "SLURM_NODEID": "0"}, 3),
    ({"SLURM_TASKS_PER_NODE": "3(x2)"}, None),  # the batch script itself, not an srun step
    ({"PMI_RANK": "0", "PMI_SIZE": "4"}, None),  # under a launcher that does not say
    ({}, None),
])
def test_the_ranks_on_this_node_come_from_the_launcher(env, expected):
    assert startup.ranks_on_this_node(env) == expected


@pytest.mark.parametrize("env,cores,expected", [
    ({"MPI_LOCALNRANKS": "4", "PMI_RANK": "1"}, 64, 16),  # the node's cores shared among its ranks
    ({"MPI_LOCALNRANKS": "4", "PMI_RANK": "1"}, 2, 1),  # never fewer than one
    ({"PMI_RANK": "0", "PMI_SIZE": "4"}, 64, 1),  # under MPI, ranks per node unknown: one
    ({"SLURM_STEP_NUM_TASKS": "16", "SLURM_NTASKS_PER_NODE": "8", "SLURM_CPUS_PER_TASK": "7"}, 56, 7),
    ({}, 64, None),  # no launcher: the libraries' own default
])
def test_each_rank_gets_its_share_of_the_cores_and_a_user_value_stands(env, cores, expected):
    env = dict(env)
    assert startup.set_host_threads(env, cores=cores) == expected
    assert all(env.get(k) == (None if expected is None else str(expected)) for k in startup.THREAD_VARIABLES)
    mine = dict(env, MPI_LOCALNRANKS="4", OMP_NUM_THREADS="3")
    mine.pop("OPENBLAS_NUM_THREADS", None), mine.pop("MKL_NUM_THREADS", None)
    assert startup.set_host_threads(mine, cores=cores) is None  # the user chose: nothing is changed
    assert mine["OMP_NUM_THREADS"] == "3" and "OPENBLAS_NUM_THREADS" not in mine


# Each rank enters the way a user's command does (`boostmpi` = boostmpi.cli:main, or `python -m
# boostmpi`), then loads NumPy, makes OpenBLAS work and counts its own threads.
THREAD_PROBE = '''
import os, runpy, sys
entry, out = sys.argv[1], sys.argv[2]
import boostmpi.cli
assert "numpy" not in sys.modules, "importing boostmpi.cli loaded NumPy"
if entry == "unset":  # the mutant: what the command line did before it set the variables
    boostmpi.cli.set_host_threads = lambda: None
sys.argv = ["boostmpi", "--version"]
try:
    if entry == "module":
        runpy.run_module("boostmpi", run_name="__main__")
    else:
        boostmpi.cli.main(["--version"])
except SystemExit:
    pass
import numpy as np
a = np.ones((512, 512))
for _ in range(3):
    a @ a  # OpenBLAS has started its pool by now
# a file per rank: the launcher may interleave the ranks' output lines
with open(os.path.join(out, f"rank-{os.environ['PMI_RANK']}"), "w") as f:
    f.write(f"{len(os.listdir('/proc/self/task'))} {os.environ.get('OPENBLAS_NUM_THREADS')}\\n")
'''


def _probe_threads(entry, **env):
    import tempfile

    from tests.support.mpi_helpers import MPIEXEC

    clean = {k: v for k, v in os.environ.items() if k not in startup.THREAD_VARIABLES}  # tests/run.sh sets them
    clean.update(env, PYTHONPATH=str(REPO))
    with tempfile.TemporaryDirectory() as out:
        p = subprocess.run(["timeout", "120", MPIEXEC, "-n", "4", sys.executable, "-c", THREAD_PROBE, entry, out],
                           env=clean, capture_output=True, text=True, timeout=150)
        assert p.returncode == 0, p.stdout + p.stderr
        rows = [Path(out, name).read_text().split() for name in sorted(os.listdir(out))]
    assert len(rows) == 4, (rows, p.stdout + p.stderr)
    return [int(r[0]) for r in rows], {r[1] for r in rows}


@pytest.mark.skipif(startup.usable_cores() < 2, reason="one core: OpenBLAS starts no extra threads to count")
def test_four_ranks_started_without_thread_variables_run_one_blas_thread_each():
    """4 ranks on this machine's cores (2 in CI): each gets cores // 4 = 1 thread, as many threads as a
    rank whose user set OPENBLAS_NUM_THREADS=1; with the setting removed (the mutant) OpenBLAS starts
    one thread per core and the count rises."""
    expected = max(1, startup.usable_cores() // 4)
    pinned, _ = _probe_threads("script", OPENBLAS_NUM_THREADS=str(expected), OMP_NUM_THREADS=str(expected))
    for entry in ("script", "module"):
        counts, values = _probe_threads(entry)
        assert values == {str(expected)}
        assert counts == pinned, (entry, counts, pinned)
    counts, values = _probe_threads("unset")
    assert values == {"None"} and min(counts) > max(pinned), (counts, pinned)


# ---------------------------------------------------------------- memory a rank may use

def test_the_cgroup_limit_is_the_tightest_of_the_process_group_and_its_parents(tmp_path):
    v2 = tmp_path / "v2"
    (v2 / "job" / "step").mkdir(parents=True)
    (v2 / "memory.max").write_text("max\n")
    (v2 / "job" / "memory.max").write_text(f"{8 * 2**30}\n")  # the job's limit
    (v2 / "job" / "step" / "memory.max").write_text("max\n")
    proc = tmp_path / "cgroup"
    proc.write_text("0::/job/step\n")
    assert startup.cgroup_memory_limit(str(v2), str(proc)) == 8 * 2**30
    v1 = tmp_path / "v1"
    (v1 / "memory" / "slurm").mkdir(parents=True)
    (v1 / "memory" / "slurm" / "memory.limit_in_bytes").write_text(f"{2**30}\n")
    (v1 / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    proc.write_text("12:cpu,cpuacct:/slurm\n7:memory:/slurm\n")
    assert startup.cgroup_memory_limit(str(v1), str(proc)) == 2**30
    proc.write_text("0::/\n")
    (v2 / "memory.max").write_text("max\n")
    assert startup.cgroup_memory_limit(str(v2), str(proc)) is None


@pytest.mark.parametrize("env,cgroup,total,ranks,expected,named", [
    ({}, None, 64 * 2**30, 4, 16 * 2**30, "the machine's MemTotal 64.0 GiB over 4 ranks on this node"),
    ({}, 8 * 2**30, 64 * 2**30, 2, 4 * 2**30, "the cgroup's memory.max 8.0 GiB over 2 ranks on this node"),
    ({"SLURM_MEM_PER_NODE": "4096"}, None, 64 * 2**30, 1, 4 * 2**30, "Slurm's --mem=4096M"),
    ({"SLURM_MEM_PER_CPU": "1024", "SLURM_CPUS_PER_TASK": "3"}, None, 64 * 2**30, 8, 3 * 2**30,
     "Slurm's --mem-per-cpu=1024M x 3 CPU(s) of this task"),
])
def test_host_memory_per_rank_takes_the_smallest_share(env, cgroup, total, ranks, expected, named):
    assert startup.host_memory_per_rank(env, ranks, cgroup=cgroup, total=total) == (expected, named)


def test_a_model_that_cannot_fit_is_refused_naming_its_parts_and_the_limit(monkeypatch):
    from boostmpi.config import load_config

    big = load_config(REPO / "configs" / "tiny.toml", overrides=["model.d_model=1048576", "model.rank=262144",
                                                                  "model.d_ff=4194304"], world_size=1)

    memory = memory_estimate(big)
    problem = startup.memory_problem(memory, 64 * 2**30, "the machine's MemTotal 64.0 GiB", "host")
    assert problem.startswith("this model needs about ") and "but a rank may use 64.0 GiB of host memory" in problem
    assert all(f"{k} " in problem for k in ("params", "grads", "optimizer", "activations"))
    tiny = memory_estimate(load_config(REPO / "configs" / "tiny.toml", world_size=1))
    assert startup.memory_problem(tiny, 64 * 2**30, "x", "host") is None
    assert startup.memory_problem(tiny, tiny["total"] - 1, "x", "host") is not None  # the check can fail
    # the GPU path compares with the memory of the GPU the rank will use
    cupy = _fake_cupy(monkeypatch, 2)
    cupy.cuda.runtime.getDeviceProperties = lambda device: {"totalGlobalMem": 40 * 2**30}
    gpu = load_config(REPO / "configs" / "tiny.toml", overrides=["train.device=gpu", "model.vocab_size=100000000"],
                      world_size=1)
    with pytest.raises(UserError, match=r"of device memory here \(GPU 1's total memory\)"):
        startup.check_memory(gpu, None, 3, memory_estimate(gpu))


# A fresh `boostmpi train` of 2 steps that reports its peak resident memory (ru_maxrss, kB on Linux):
# what the kernel's out-of-memory killer would have counted, with no cgroup needed.
PEAK_PROBE = '''
import os, resource, sys
from boostmpi.cli import main
status = main(sys.argv[2:])
with open(os.path.join(sys.argv[1], f"rank-{os.environ.get('PMI_RANK', '0')}"), "w") as f:
    f.write(f"{status} {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}\\n")
'''

SMALL_HEADS = ["model.n_heads=8", "model.n_kv_heads=4"]
# (ranks, overrides of configs/tiny.toml, the term of the estimate whose removal the run must expose)
MEASURED_RUNS = {
    # the model the old estimate put lowest against its peak: its weights dominate, and AdamW's
    # scratch and clipped gradient are as large as its moments
    "large d_model": (1, ["model.d_model=32768"], "optimizer_scratch"),
    # a wide layer's backward at an input projection: the residual's gradient, the RMSNorm backward's
    # intermediates and the projected gradients (about 280 MB at 12 sequences; the LM head has no transient
    # of its own: it makes the probabilities in the logits' buffer). At 8 sequences (185 MB) the estimate
    # without them still bounded the peak once a CPU run stopped importing CuPy (17 MiB less resident)
    "wide layer": (1, SMALL_HEADS + ["model.d_model=1024", "model.seq_len=512", "model.vocab_size=512",
                                     "model.rank=64", "model.d_ff=2048", "train.micro_batch_size=12"],
                   "step_temporaries"),
    # a long sequence with its forward run again: the probability tiles handed to the backward
    "long sequence, recompute = layer": (1, ["model.d_model=128", "model.seq_len=1024", "model.vocab_size=512",
                                             "model.rank=32", "model.d_ff=256", "train.recompute=layer"], None),
    # two ranks, tensor-parallel: the process itself outweighs a tiny model
    "tiny, tp = 2": (2, ["parallel.tp=2"], "PROCESS_BYTES"),
    # the validation after the steps, two batches, with a vocabulary whose logits [N, V] (190 MB) outweigh
    # the layers: a forward that no backward follows keeps nothing of the vocabulary's width, so the
    # next batch's forward starts with nothing of the last one held (its probabilities held took the
    # peak 70 MiB past the estimate, which counts the step's own head only)
    "large vocabulary, validation": (1, ["model.d_model=64", "model.d_ff=128", "model.rank=16", "model.vocab_size=48000",
                                         "model.seq_len=256", "train.micro_batch_size=4", "train.recompute=layer",
                                         "train.val_windows=8"], None),
}


def _peak_of_a_run(tmp_path, ranks, overrides):
    from tests.support.mpi_helpers import MPIEXEC

    out = tmp_path / "peaks"
    out.mkdir()
    env = dict(os.environ, PYTHONPATH=str(REPO), OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    command = [sys.executable, "-c", PEAK_PROBE, str(out), *_train_args(tmp_path, *overrides)]
    if ranks > 1:
        command = [MPIEXEC, "-n", str(ranks), *command]
    p = subprocess.run(["timeout", "300", *command], env=env, capture_output=True, text=True, timeout=330)
    rows = [(tmp_path / "peaks" / name).read_text().split() for name in sorted(os.listdir(out))]
    assert p.returncode == 0 and len(rows) == ranks and all(r[0] == "0" for r in rows), p.stdout + p.stderr
    return max(int(r[1]) for r in rows)


@pytest.mark.mpi_skip  # it starts processes of its own
@pytest.mark.parametrize("case", list(MEASURED_RUNS))
def test_the_memory_estimate_bounds_the_peak_of_a_real_run(case, tmp_path, monkeypatch):
    """The check's estimate is an upper bound of what the run really holds at its peak, and not a
    loose one; without the term of the estimate that the case stresses (the mutant) it is not."""
    from boostmpi.config import load_config
    from boostmpi.sim import memory

    ranks, overrides, term = MEASURED_RUNS[case]
    peak = _peak_of_a_run(tmp_path, ranks, overrides)
    cfg = load_config(REPO / "configs" / "tiny.toml", overrides=overrides, world_size=ranks)
    estimate = memory_estimate(cfg)["total"]
    assert peak <= estimate <= max(1.5 * peak, peak + memory.PROCESS_BYTES), (peak, estimate)
    step_model = sum(memory_estimate(cfg)[k] for k in ("params", "grads", "optimizer", "activations"))
    assert step_model < peak  # the step model's figure alone, what the check compared before, is not a bound
    if term is None:
        return
    if term == "PROCESS_BYTES":
        monkeypatch.setattr(memory, term, 0)
    else:
        monkeypatch.setattr(memory, term, lambda *args: 0)
    assert memory_estimate(cfg)["total"] < peak, f"without {term} the estimate still bounds the peak"


def test_the_gpu_path_adds_only_the_optimizers_device_scratch():
    """On a GPU the workspace is AdamW's scratch and clipped gradient on the device (one moment each);
    the host's temporaries stay out, and `boostmpi sim` keeps the step model's own figure."""
    from boostmpi.config import load_config
    from boostmpi.sim.machines import builtin_names, load_machine
    from boostmpi.sim.model import predict

    for clip, buffers in (("1.0", 2), ("0", 1)):
        cfg = load_config(REPO / "configs" / "tiny.toml", overrides=["train.device=gpu", f"train.grad_clip={clip}"],
                          world_size=1)
        step_model = predict(cfg, load_machine(builtin_names()[0])).memory_bytes
        memory = memory_estimate(cfg)
        assert memory["workspace"] == buffers * step_model["optimizer"] // 2
        assert memory["total"] == step_model["total"] + memory["workspace"]
