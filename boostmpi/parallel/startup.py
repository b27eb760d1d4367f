"""Start-up checks, run on every rank before any training work, so that a wrong setting shows in
the first lines of the log instead of as a slow or silently broken run.

- `set_host_threads()`: called by the command line before NumPy is imported. Under a launcher,
  each rank gets the node's cores divided by the ranks on the node as its BLAS/OpenMP threads
  (OMP_NUM_THREADS, OPENBLAS_NUM_THREADS, MKL_NUM_THREADS), 1 when the launcher does not say how
  many ranks share the node; a value the user set is never changed. Left alone, every rank's
  OpenBLAS starts one thread per core and the ranks of a node fight over the same cores.
- `check_mpi(world, rank, local_rank)`: prints (rank 0) the MPI library, the file it was loaded
  from, its transport where the library says so, and how many nodes the ranks span. It refuses a
  multi-node batch job (Slurm or PBS) that runs on the MPICH wheel from PyPI: that MPICH's own
  network stack cannot use the site's high-speed network (Slingshot's `cxi`), so the job would
  crawl over TCP or die at launch. `BOOSTMPI_ALLOW_PYPI_MPI=1` overrides. It also refuses ranks
  that each see a world of one while the launcher started several: an MPI that cannot talk to
  the launcher (each rank would train alone).
- `select_gpu(world, local_rank)`: makes this rank's GPU current, then every rank gathers the
  PCI bus id of its GPU. Two ranks of one node on the same GPU stop the job (with one GPU visible
  per rank, device ids alone cannot show that), and so does a GPU-mapping variable that the job
  promised (`BOOSTMPI_GPU_MAP_VAR`, set by the Polaris job to `PMI_LOCAL_RANK`) but the launcher
  did not set.
- `process_grid(cfg, world, local_rank)`: the decisions above that shape the process grid, then the
  grid itself, before any weight exists.
- `resolve_comm(requested, world)`: for GPU runs, "nccl" when every rank can load NCCL (RCCL on
  ROCm), else "mpi" with a warning for `parallel.comm = "auto"`, or a stop for `"nccl"`. MPI
  carrying GPU buffers on Cray MPICH needs MPICH_GPU_SUPPORT_ENABLED=1: checked here too.

Every verdict that ends the job is reached from gathered or reduced values, so all ranks raise
the same UserError together (exit 2, printed once) and none is left waiting in a collective.
"""

from __future__ import annotations

import glob
import importlib.metadata
import os
import re
import sys
from collections.abc import Callable, Collection, Mapping, MutableMapping, Sequence
from typing import TYPE_CHECKING, TextIO

from boostmpi.errors import UserError

if TYPE_CHECKING:
    from mpi4py import MPI

    from boostmpi.config import Config
    from boostmpi.gpu.attention import AttentionBackend
    from boostmpi.parallel.grid import ProcessGrid

ALLOW_PYPI_MPI = "BOOSTMPI_ALLOW_PYPI_MPI"
GPU_MAP_VAR = "BOOSTMPI_GPU_MAP_VAR"
SITE_SETUP = "jobs/setup_frontier.sh, jobs/setup_perlmutter.sh or jobs/setup_polaris.sh"


# ---------------------------------------------------------------- host threads per rank

THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
# variables that only a launcher sets in the processes it starts: Hydra/PALS PMI, Open MPI, srun
_LAUNCHED = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PALS_RANKID", "SLURM_STEP_NUM_TASKS")


def slurm_tasks_on_node(spec: str, node_id: int) -> int | None:
    """Tasks on node `node_id` from Slurm's compressed per-node list ("4(x2),3": 4, 4, 3), or None."""
    counts = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if m is None:
            return None
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    if not counts:
        return None
    return counts[node_id] if 0 <= node_id < len(counts) else counts[0]


def ranks_on_this_node(environ: Mapping[str, str]) -> int | None:
    """How many ranks the launcher started on this node, or None when it does not say.

    MPICH's Hydra: MPI_LOCALNRANKS; Open MPI: OMPI_COMM_WORLD_LOCAL_SIZE; HPE PALS (Polaris):
    PALS_LOCAL_SIZE; Slurm's srun: SLURM_STEP_TASKS_PER_NODE, else SLURM_NTASKS_PER_NODE, else
    SLURM_TASKS_PER_NODE (https://slurm.schedmd.com/srun.html#SECTION_OUTPUT-ENVIRONMENT-VARIABLES),
    the compressed lists indexed by SLURM_NODEID."""
    for key in ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "PALS_LOCAL_SIZE"):
        value = environ.get(key, "").strip()
        if value.isdigit() and int(value) > 0:
            return int(value)
    if environ.get("SLURM_STEP_NUM_TASKS"):  # inside an srun step, not the batch script itself
        node = environ.get("SLURM_NODEID", "0")
        for key in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
            count = slurm_tasks_on_node(environ.get(key, ""), int(node) if node.isdigit() else 0)
            if count:
                return count
    return None


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity), else the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def host_threads(environ: Mapping[str, str], cores: int) -> int | None:
    """BLAS/OpenMP threads per rank: `cores` divided by the ranks on this node (at least 1); 1 under
    a launcher that does not say how many ranks share the node; None (leave the libraries' default)
    for a process started without a launcher."""
    per_task = environ.get("SLURM_CPUS_PER_TASK", "")
    if environ.get("SLURM_STEP_NUM_TASKS") and per_task.isdigit() and int(per_task) > 0:
        return int(per_task)  # srun --cpus-per-task: the cores Slurm gave this task
    ranks = ranks_on_this_node(environ)
    if ranks is not None:
        return max(1, cores // ranks)
    if any(environ.get(key) for key in _LAUNCHED):
        return 1
    return None


def set_host_threads(environ: MutableMapping[str, str] | None = None, cores: int | None = None) -> int | None:
    """Set the thread variables for this rank unless the user set any of them; must run before NumPy
    is imported (OpenBLAS sizes its thread pool when it loads). Returns the count set, or None."""
    environ = os.environ if environ is None else environ
    if any(environ.get(key) for key in THREAD_VARIABLES):
        return None  # the user chose: theirs stands
    threads = host_threads(environ, usable_cores() if cores is None else cores)
    if threads is not None:
        for key in THREAD_VARIABLES:
            environ[key] = str(threads)
    return threads


# ---------------------------------------------------------------- memory a rank may use

_UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a number near 2**63


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except (OSError, UnicodeDecodeError):
        return ""


def cgroup_memory_limit(root: str = '/sys/fs/cgroup', proc: str = '/proc/self/cgroup') -> int | None:
    """The tightest memory limit of this process's cgroup and its parents (cgroup v2 memory.max,
    v1 memory.limit_in_bytes), in bytes, or None when there is none."""
    limits = []
    for line in _read(proc).splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # v2: one unified hierarchy
            folder, name = os.path.join(root, path.lstrip("/")), "memory.max"
        elif "memory" in controllers.split(","):
            folder, name = os.path.join(root, "memory", path.lstrip("/")), "memory.limit_in_bytes"
        else:
            continue
        while True:  # the limit of a parent applies too
            value = _read(os.path.join(folder, name)).strip()
            if value.isdigit() and int(value) < _UNLIMITED:
                limits.append(int(value))
            if os.path.normpath(folder) == os.path.normpath(root) or folder in ("/", ""):
                break
            folder = os.path.dirname(folder)
    return min(limits) if limits else None


def machine_memory(meminfo: str = '/proc/meminfo') -> int | None:
    m = re.search(r"^MemTotal:\s+(\d+) kB", _read(meminfo), re.M)
    return int(m.group(1)) * 1024 if m else None


def host_memory_per_rank(environ: Mapping[str, str], local_ranks: int, cgroup: int | None = None,
                         total: int | None = None) -> tuple[int | None, str | None]:
    """(bytes one rank may use, where that figure comes from) or (None, None): the node's limit (the
    cgroup's memory.max, Slurm's --mem, else the machine's MemTotal) shared among its ranks, or
    Slurm's --mem-per-cpu for this task, whichever is smaller."""
    cgroup = cgroup_memory_limit() if cgroup is None else cgroup
    total = machine_memory() if total is None else total
    found = []
    share = f" over {local_ranks} ranks on this node" if local_ranks > 1 else ""
    for value, what in ((cgroup, "the cgroup's memory.max"), (total, "the machine's MemTotal")):
        if value:
            found.append((value // local_ranks, f"{what} {_gib(value)}{share}"))
    per_node = environ.get("SLURM_MEM_PER_NODE", "")
    if per_node.isdigit() and int(per_node) > 0:  # megabytes (https://slurm.schedmd.com/sbatch.html)
        found.append((int(per_node) * 2**20 // local_ranks, f"Slurm's --mem={per_node}M{share}"))
    per_cpu, cpus = environ.get("SLURM_MEM_PER_CPU", ""), environ.get("SLURM_CPUS_PER_TASK", "1")
    if per_cpu.isdigit() and int(per_cpu) > 0:
        n = int(cpus) if cpus.isdigit() and int(cpus) > 0 else 1
        found.append((int(per_cpu) * 2**20 * n, f"Slurm's --mem-per-cpu={per_cpu}M x {n} CPU(s) of this task"))
    return min(found) if found else (None, None)


def _gib(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB"


def memory_problem(memory: Mapping[str, int] | None, limit: int | None, where: str | None, device: str) -> str | None:
    """The one-line reason to refuse, or None."""
    if memory is None or limit is None or memory["total"] <= limit:
        return None
    parts = ", ".join(f"{k} {_gib(memory[k])}" for k in ("params", "grads", "optimizer", "activations", "workspace"))
    return (f"this model needs about {_gib(memory['total'])} per rank ({parts}; an estimate) but a rank may use "
            f"{_gib(limit)} of {device} memory here ({where}): shrink the model (model.vocab_size, model.d_model, "
            f"model.n_layers, train.micro_batch_size) or spread it over more ranks (parallel.tp, parallel.pp)")


def weights_lower_bound(cfg: Config) -> int:
    """Bytes per rank that the layers' weights, gradients and AdamW moments need at the least, in
    closed form (no walk over the layers): the largest stage's ceil(L / pp) layers over tp ranks, at
    the dtype's size for weights and gradients, a float32 master copy for bfloat16, and two float32
    moments (divided over dp under ZeRO-1). The embedding, the head and activations come on top."""
    m, par, tr = cfg.model, cfg.parallel, cfg.train
    per_layer = 2 * m.d_model  # the two norms
    for d_in, d_out, r in m.linear_shapes().values():
        per_layer += d_in * d_out if r is None else r * (d_in + d_out)
    layers = -(-m.n_layers // par.pp)
    itemsize = {"float64": 8, "float32": 4, "bfloat16": 2}.get(tr.dtype, 2)
    moments = 8 / (par.dp if par.zero_stage >= 1 else 1)
    per_param = 2 * itemsize + (4 if tr.dtype == "bfloat16" else 0) + moments
    return int(layers * per_layer / par.tp * per_param)


def size_problem(cfg: Config, limit: int | None, where: str | None, device: str) -> str | None:
    """The one-line reason to refuse a model whose weights alone exceed `limit`, or None."""
    need = weights_lower_bound(cfg)
    if limit is None or need <= limit:
        return None
    return (f"this model's {cfg.model.n_layers:,} layers need at least {_gib(need)} per rank for their weights, "
            f"gradients and optimizer state alone but a rank may use {_gib(limit)} of {device} memory here ({where}): "
            f"shrink the model (model.n_layers, model.d_model) or spread it over more ranks (parallel.tp, parallel.pp)")


def check_memory(cfg: Config, world: MPI.Comm | None, local_rank: int,
                 memory: Mapping[str, int] | Callable[[], Mapping[str, int] | None] | None,
                 environ: Mapping[str, str] | None = None) -> None:
    """Stop (every rank together, exit 2) a model that cannot fit in what a rank may use, before
    anything is allocated: host memory on the CPU path, the GPU's memory on the GPU path. `memory`:
    the performance model's estimate per rank (`boostmpi.sim.model.memory_estimate`), or None, or a
    function giving it: then a model whose weights alone cannot fit (`weights_lower_bound`, closed
    form) is refused first, without the estimate's walk over every layer."""
    environ = os.environ if environ is None else environ
    from boostmpi.parallel.comm import HostCollectives

    host = HostCollectives(world)
    if cfg.train.device == "gpu":
        from boostmpi.backend import get_xp

        try:  # no CuPy, or no GPU it can reach: one line, every rank together
            get_xp("gpu")
        except UserError as exc:
            host.agree(("UserError", str(exc)))
        import cupy

        device = local_rank % cupy.cuda.runtime.getDeviceCount()  # the GPU select_device will choose
        limit: int | None = int(cupy.cuda.runtime.getDeviceProperties(device)["totalGlobalMem"])
        where: str | None = f"GPU {device}'s total memory"
        kind = "device"
    else:
        from mpi4py import MPI

        name = MPI.Get_processor_name()
        local_ranks = host.allgather(name).count(name)
        limit, where = host_memory_per_rank(environ, local_ranks)
        kind = "host"
    problem = None
    if callable(memory):
        problem = size_problem(cfg, limit, where, kind)
        memory = None if problem else memory()
    problem = problem or memory_problem(memory, limit, where, kind)
    host.agree(("UserError", problem) if problem else None)  # the first rank's problem stops every rank


# ---------------------------------------------------------------- MPI library and transport

def loaded_mpi_library(maps: str = '/proc/self/maps') -> str | None:
    """Path of the MPI shared library this process has loaded, or None when it cannot be told."""
    try:
        with open(maps) as f:
            paths = {line.split()[-1] for line in f if "/" in line}
    except OSError:
        return None
    names = re.compile(r"^lib(mpi|mpich)(_[a-z0-9_]+)?\.so")  # libmpi, libmpich, Cray's libmpi_gnu_123
    found = sorted(p for p in paths if names.match(os.path.basename(p)) and "fort" not in p and "cxx" not in p)
    return found[0] if found else None


def pypi_mpich_libraries() -> set[str]:
    """The shared libraries of the `mpich` wheel from PyPI in this environment (empty when absent)."""
    try:
        dist = importlib.metadata.distribution("mpich")
    except importlib.metadata.PackageNotFoundError:
        return set()
    return {os.path.realpath(str(dist.locate_file(f))) for f in dist.files or () if ".so" in f.name}


def is_pypi_mpich(library_path: str | None, wheel_libraries: set[str]) -> bool:
    """True when the loaded MPI is the PyPI wheel's (unknown path: when the wheel is installed)."""
    if library_path is None:
        return bool(wheel_libraries)
    return os.path.realpath(library_path) in wheel_libraries


def transport(version_text: str, environ: Mapping[str, str]) -> str:
    """What the MPI library says about its transport, plus the variables that choose one."""
    device = re.search(r"MPICH Device:[ \t]*([^\n]+)", version_text)
    if device:
        what = device.group(1)  # ch4:ofi (libfabric), ch4:ucx, ch3:nemesis...
    elif "CRAY MPICH" in version_text:
        what = "ofi (Cray MPICH over libfabric; cxi on Slingshot)"
    elif "Open MPI" in version_text:
        what = "chosen at run time by Open MPI"
    else:
        what = "not reported by the library"
    chosen = [f"{k}={environ[k]}" for k in ("FI_PROVIDER", "UCX_TLS", "OMPI_MCA_pml") if environ.get(k)]
    return what + (f" ({', '.join(chosen)})" if chosen else "")


def scheduler(environ: Mapping[str, str]) -> str | None:
    """'Slurm', 'PBS' or None: the batch system this process runs under."""
    if environ.get("SLURM_JOB_ID"):
        return "Slurm"
    if environ.get("PBS_JOBID"):
        return "PBS"
    return None


def launcher_task_count(environ: Mapping[str, str]) -> int | None:
    """How many tasks the launcher says it started (srun, Hydra/PALS PMI), or None."""
    for key in ("SLURM_STEP_NUM_TASKS", "PMI_SIZE", "PALS_SIZE"):
        value = environ.get(key, "")
        if value.isdigit():
            return int(value)
    return None


def site_mpi_problem(nodes: int, batch_system: str | None, pypi: bool, environ: Mapping[str, str]) -> str | None:
    """The one-line reason to refuse this job's MPI, or None."""
    if nodes < 2 or batch_system is None or not pypi or environ.get(ALLOW_PYPI_MPI) == "1":
        return None
    return (f"this {nodes}-node {batch_system} job runs on the MPICH wheel from PyPI, whose own network stack "
            f"cannot use the site's high-speed network; install boostmpi without the [mpich] extra and build "
            f"mpi4py against the site's MPI ({SITE_SETUP}), or set {ALLOW_PYPI_MPI}=1 to run on it anyway")


def count_nodes(world: MPI.Comm | None, local_rank: int) -> int:
    """How many nodes the ranks span, by MPI's own account (ranks sharing memory form a node)."""
    from boostmpi.parallel.comm import HostCollectives

    return 1 if world is None else int(HostCollectives(world).sum([int(local_rank == 0)])[0])


def check_mpi(world: MPI.Comm | None, rank: int, local_rank: int, environ: Mapping[str, str] | None = None,
              out: TextIO | None = None) -> int:
    """Print what MPI this job runs on (rank 0) and stop a job whose MPI cannot serve it."""
    from mpi4py import MPI

    from boostmpi.parallel.comm import HostCollectives

    environ = os.environ if environ is None else environ
    out = out or sys.stdout
    size = 1 if world is None else world.Get_size()
    tasks = launcher_task_count(environ)
    if size == 1 and tasks is not None and tasks > 1:
        # every process is a world of its own: nothing collective can follow, each one stops
        raise UserError(f"the launcher started {tasks} tasks but MPI sees a world of 1 rank: mpi4py's MPI cannot "
                        f"talk to this launcher (for example the PyPI MPICH under srun or PALS); build mpi4py "
                        f"against the MPI the launcher belongs to ({SITE_SETUP})")
    library = loaded_mpi_library()
    pypi = is_pypi_mpich(library, pypi_mpich_libraries())
    nodes = count_nodes(world, local_rank)
    any_pypi = pypi if world is None else bool(HostCollectives(world).max([int(pypi)])[0])
    version = MPI.Get_library_version()
    if rank == 0:
        name = version.strip().splitlines()[0].strip()
        print(f"mpi: {name} | {library or 'library file unknown'}{' (PyPI wheel)' if pypi else ''} | "
              f"transport {transport(version, environ)} | {size} rank(s) on {nodes} node(s)", file=out, flush=True)
    problem = site_mpi_problem(nodes, scheduler(environ), any_pypi, environ)
    if problem:
        raise UserError(problem)
    return nodes


# ---------------------------------------------------------------- one GPU per rank

def gpu_pci_bus_id(device_id: int) -> str:
    """The PCI bus id of CUDA/ROCm device `device_id` as this process sees it (lower case)."""
    import cupy

    bus = getattr(cupy.cuda.Device(device_id), "pci_bus_id", None)
    if bus is None:
        bus = cupy.cuda.runtime.deviceGetPCIBusId(device_id)
    return str(bus).strip().lower()


def gpu_mapping_problem(records: Sequence[tuple[str, int, str, str, bool]]) -> str | None:
    """The one-line reason to stop, or None. `records`: one (host, rank, PCI bus id, GPU-map variable
    name or "", whether that variable is set) per rank, gathered from all ranks."""
    unset = [(rank, var) for _, rank, _, var, is_set in records if var and not is_set]
    if unset:
        var = unset[0][1]
        return (f"{var} is not set on rank(s) {_ranks([r for r, _ in unset])}, but the job maps GPUs to ranks from "
                f"it ({GPU_MAP_VAR}={var}): start the ranks with the launcher the job script names")
    owners: dict[tuple[str, str], list[int]] = {}
    for host, rank, bus, _, _ in records:
        owners.setdefault((host, bus), []).append(rank)
    for (host, bus), ranks in sorted(owners.items()):
        if len(ranks) > 1:
            return (f"ranks {_ranks(ranks)} on node {host} share the GPU at PCI bus {bus}: each rank needs its own "
                    f"GPU; check the launcher's GPU binding (srun --gpus-per-task=1 --gpu-bind=closest, or the "
                    f"job's CUDA_VISIBLE_DEVICES wrapper) and the ranks per node")
    return None


def check_gpu_per_rank(world: MPI.Comm | None, rank: int, bus_id: str, environ: Mapping[str, str] | None = None,
                       out: TextIO | None = None) -> None:
    """Gather every rank's GPU bus id; stop (all ranks together) on a shared GPU or an unset map variable."""
    from mpi4py import MPI

    from boostmpi.parallel.comm import HostCollectives

    environ = os.environ if environ is None else environ
    out = out or sys.stdout
    map_var = environ.get(GPU_MAP_VAR, "")
    record = (MPI.Get_processor_name(), rank, bus_id, map_var, environ.get(map_var, "") != "" if map_var else True)
    records = HostCollectives(world).allgather(record)
    problem = gpu_mapping_problem(records)
    if problem:
        raise UserError(problem)
    if rank == 0:
        per_node: dict[str, list[str]] = {}
        for host, r, bus, _, _ in records:
            per_node.setdefault(host, []).append(f"{r}:{bus}")
        shown = "; ".join(f"{host} {' '.join(v)}" for host, v in sorted(per_node.items())[:4])
        more = f" (+{len(per_node) - 4} more nodes)" if len(per_node) > 4 else ""
        print(f"gpus: one per rank, rank:PCI bus | {shown}{more}", file=out, flush=True)


def select_gpu(world: MPI.Comm | None, local_rank: int) -> int:
    """Make this rank's GPU current (by local rank) and verify that no two ranks of a node share one."""
    from boostmpi.parallel.nccl import select_device

    device = select_device(local_rank)
    rank = 0 if world is None else world.Get_rank()
    check_gpu_per_rank(world, rank, gpu_pci_bus_id(device))
    return device


# ---------------------------------------------------------------- NCCL / RCCL

def net_plugins(environ: Mapping[str, str]) -> list[str]:
    """NCCL/RCCL network plugin libraries the dynamic loader can find (NCCL_NET_PLUGIN, LD_LIBRARY_PATH)."""
    found = []
    named = environ.get("NCCL_NET_PLUGIN", "")
    if named and os.path.isfile(named):
        found.append(named)
    for folder in filter(None, environ.get("LD_LIBRARY_PATH", "").split(":")):
        found += sorted(glob.glob(os.path.join(folder, "lib*ccl-net*.so")))
    return list(dict.fromkeys(found))


def _nccl_version() -> str:
    try:
        from cupy.cuda import nccl

        v = int(nccl.get_version())
        return f"{v // 10000}.{v // 100 % 100}.{v % 100}" if v >= 10000 else f"{v // 1000}.{v // 100 % 10}.{v % 100}"
    except Exception:  # noqa: BLE001 - the version is for the log only
        return "version unknown"


def resolve_comm(requested: str, world: MPI.Comm | None, environ: Mapping[str, str] | None = None,
                 out: TextIO | None = None, err: TextIO | None = None) -> str:
    """'nccl' or 'mpi' for a GPU run: what `parallel.comm` ("auto", "nccl", "mpi") becomes here."""
    from mpi4py import MPI

    from boostmpi.parallel.comm import HostCollectives
    from boostmpi.parallel.nccl import nccl_unavailable_reason

    environ = os.environ if environ is None else environ
    out, err = out or sys.stdout, err or sys.stderr
    rank = 0 if world is None else world.Get_rank()
    choice = "mpi"
    if requested in ("auto", "nccl"):
        reason = nccl_unavailable_reason()
        missing = bool(HostCollectives(world).max([int(reason is not None)])[0])
        if not missing:
            choice = "nccl"
        elif requested == "nccl":
            raise UserError(f"parallel.comm = \"nccl\" but {reason or 'NCCL cannot be loaded on some rank'}; "
                            f"install it or set parallel.comm = \"mpi\"")
        elif rank == 0:
            print(f"warning: parallel.comm = \"auto\" but {reason or 'NCCL cannot be loaded on some rank'}; "
                  f"the GPUs exchange data through MPI instead", file=err, flush=True)
    if choice == "mpi" and "CRAY MPICH" in MPI.Get_library_version() and environ.get("MPICH_GPU_SUPPORT_ENABLED") != "1":
        raise UserError("MPI would carry GPU buffers but MPICH_GPU_SUPPORT_ENABLED is not 1: set it (with the "
                        "craype-accel module of the GPU loaded) or make NCCL/RCCL available")
    if rank == 0:
        if choice == "nccl":
            plugins = net_plugins(environ)
            print(f"comm: nccl {_nccl_version()} | NCCL_NET={environ.get('NCCL_NET', '(unset: any network)')} | "
                  f"net plugin {', '.join(plugins) if plugins else 'none found'}", file=out, flush=True)
        else:
            print("comm: mpi (GPU buffers through MPI)", file=out, flush=True)
    return choice


def _ranks(ranks: Collection[int]) -> str:
    return ", ".join(str(r) for r in sorted(ranks)[:8]) + (" ..." if len(ranks) > 8 else "")


# ---------------------------------------------------------------- the process grid

def attention_shape(cfg: Config) -> tuple[int, int, int, int, int]:
    """(B, T, H, Hkv, Dh) of one rank's attention call: the micro-batch, the heads split by tensor parallelism."""
    m, tp = cfg.model, cfg.parallel.tp
    return (cfg.train.micro_batch_size, m.seq_len, m.n_heads // tp, m.n_kv_heads // tp, m.head_dim)


def choose_attention(cfg: Config, world: MPI.Comm | None) -> AttentionBackend:
    """Decide `train.attention` once for all ranks, after this rank's device is set (boostmpi.gpu.attention
    `select`): a backend that cannot run is a one-line error on every rank, and ranks whose "auto"
    resolved differently (different GPUs or installs) are refused in one line; the choice is installed
    as the process-wide backend. The fallback line of "auto" is printed by world rank 0 only."""
    import io

    from boostmpi.errors import UserError
    from boostmpi.gpu import attention
    from boostmpi.parallel.comm import HostCollectives

    host = HostCollectives(world)
    out = None if world is None or world.Get_rank() == 0 else io.StringIO()
    choice = verdict = None
    try:
        choice = attention.select(cfg.train.attention, cfg.train.dtype, shape=attention_shape(cfg), out=out,
                                  deterministic=cfg.train.deterministic)
    except attention.BackendUnavailable as e:
        verdict = ("UserError", str(e))
    host.agree(verdict)
    assert choice is not None  # agree raised on every rank otherwise
    names = host.allgather(choice.name)
    if len(set(names)) > 1:
        chosen = ", ".join(f"rank {r} {n}" for r, n in enumerate(names))
        raise UserError(f"train.attention = {cfg.train.attention} chose different backends on the ranks ({chosen}): "
                        "name one in train.attention that runs on every rank")
    return attention.use(choice)


def process_grid(cfg: Config, world: MPI.Comm | None, local_rank: int = 0) -> ProcessGrid:
    """This rank's ProcessGrid, built after the decisions that shape it and before any weight is drawn:
    a configuration only the performance model can run is refused; on the CPU glibc keeps freed
    memory (`keep_host_memory`); on a GPU this rank's device is chosen and checked (`select_gpu`),
    the attention backend is chosen for all ranks (`choose_attention`), MPI is told to wait for the
    stream before reading GPU buffers (CUDA-aware MPI), and the
    collective library is chosen (`resolve_comm`: "auto" falls back to MPI without NCCL); the
    watchdog gets `parallel.watchdog_s`."""
    from boostmpi.backend import get_xp, keep_host_memory
    from boostmpi.parallel.comm import configure_watchdog
    from boostmpi.parallel.grid import ProcessGrid

    cfg.check_runnable()  # nothing only the performance model understands
    par = cfg.parallel
    xp = get_xp(cfg.train.device)
    sync, use_nccl = None, False
    if cfg.train.device == "cpu":
        keep_host_memory()
    else:
        select_gpu(world, local_rank)  # and no two ranks of a node on one GPU
        from boostmpi.gpu.kernels import attention_tensor_cores_problem
        from boostmpi.parallel.comm import HostCollectives

        problem = attention_tensor_cores_problem("bf16" if cfg.train.dtype == "bfloat16" else "f32")
        HostCollectives(world).agree(("UserError", problem) if problem else None)
        from boostmpi.precision import compute_dtype

        compute_dtype(cfg.train.dtype, xp)  # an unusable CuPy/NumPy stack is refused before any backend is tried
        choose_attention(cfg, world)
        sync = lambda: xp.cuda.get_current_stream().synchronize()  # noqa: E731
        use_nccl = resolve_comm(par.comm, world) == "nccl"
    configure_watchdog(par.watchdog_s)  # a collective waiting longer than this ends the job
    return ProcessGrid(world, par.tp, par.pp, par.dp, overlap=par.overlap, sync=sync, use_nccl=use_nccl,
                       ring=par.virtual_stages > 1)
