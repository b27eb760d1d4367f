"""Give each rank the GPU on its own NUMA domain, keeping every GPU of the node visible.

Used by jobs/perlmutter.sbatch as the program srun starts, in front of the training command:

    srun ... --cpu-bind=cores --gpu-bind=none python3 jobs/gpu_numa.py -- <command...>

boostmpi makes GPU `local rank mod visible` current. With --gpu-bind=none every rank sees the node's
GPUs (which CUDA IPC between the ranks of a node needs), in PCI order, so without help local rank r
takes GPU r whatever NUMA domain srun bound its cores to. This helper reads the node's layout from
sysfs (each GPU's PCI device `numa_node`, each NUMA node's `cpulist`) and `nvidia-smi`'s PCI bus ids,
then sets one node-wide order, CUDA_VISIBLE_DEVICES = the GPUs sorted by NUMA node with
CUDA_DEVICE_ORDER=PCI_BUS_ID, so that position r holds the GPU of NUMA node r; and it checks that
this rank's cores (sched_getaffinity) lie on the NUMA node of the GPU it will take. A rank whose
cores and GPU are on different NUMA nodes stops (status 2) with one line naming both. The layout
is measured on the node, not assumed.

BOOSTMPI_SYSFS (default /sys) and BOOSTMPI_NVIDIA_SMI (default nvidia-smi) point at other sources.
"""

import os
import subprocess
import sys


def parse_cpulist(text):
    """'0-15,64-79' -> {0..15, 64..79}."""
    cpus = set()
    for part in filter(None, text.strip().split(",")):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def numa_cpus(sysfs):
    """{NUMA node: set of CPUs} of this node."""
    root = os.path.join(sysfs, "devices", "system", "node")
    found = {}
    for name in sorted(os.listdir(root)):
        if name.startswith("node") and name[4:].isdigit():
            with open(os.path.join(root, name, "cpulist")) as f:
                found[int(name[4:])] = parse_cpulist(f.read())
    return found


def gpu_numa_nodes(sysfs, nvidia_smi):
    """[(PCI bus id, NUMA node)] of the node's GPUs, in nvidia-smi's (PCI) order."""
    out = subprocess.run([nvidia_smi, "--query-gpu=pci.bus_id", "--format=csv,noheader"], check=True,
                         capture_output=True, text=True).stdout
    gpus = []
    for line in filter(None, (x.strip() for x in out.splitlines())):
        domain, rest = line.lower().split(":", 1)
        sysfs_id = f"{int(domain, 16):04x}:{rest}"  # nvidia-smi: 00000000:03:00.0; sysfs: 0000:03:00.0
        with open(os.path.join(sysfs, "bus", "pci", "devices", sysfs_id, "numa_node")) as f:
            gpus.append((line, int(f.read().strip())))
    return gpus


def plan(gpus, numa, cpus, local_rank):
    """(CUDA_VISIBLE_DEVICES value, problem or None) for the rank with `cpus` and `local_rank`."""
    order = sorted(range(len(gpus)), key=lambda i: (gpus[i][1], i))
    visible = ",".join(str(i) for i in order)
    mine = order[local_rank % len(order)]
    bus, node = gpus[mine]
    homes = sorted({n for n, members in numa.items() if cpus & members})
    if homes != [node]:
        return visible, (f"local rank {local_rank} would take the GPU at {bus} on NUMA node {node}, but its cores "
                         f"{_ranges(cpus)} are on NUMA node(s) {','.join(map(str, homes)) or 'none'}: "
                         f"the ranks' CPU binding does not follow the node's GPU layout (check -c and --cpu-bind)")
    return visible, None


def _ranges(cpus):
    cpus, parts, start = sorted(cpus), [], None
    for i, c in enumerate(cpus):
        if start is None:
            start = c
        if i + 1 == len(cpus) or cpus[i + 1] != c + 1:
            parts.append(f"{start}-{c}" if c != start else str(c))
            start = None
    return ",".join(parts)


def main(argv):
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        print("usage: gpu_numa.py -- COMMAND...", file=sys.stderr)
        return 2
    command = argv[argv.index("--") + 1:]
    local = os.environ.get("SLURM_LOCALID", "")
    if not local.isdigit():
        print("error: SLURM_LOCALID is not set: start the ranks with srun (it gives each rank its local id)",
              file=sys.stderr)
        return 2
    sysfs = os.environ.get("BOOSTMPI_SYSFS", "/sys")
    try:
        gpus = gpu_numa_nodes(sysfs, os.environ.get("BOOSTMPI_NVIDIA_SMI", "nvidia-smi"))
        numa = numa_cpus(sysfs)
    except (OSError, ValueError, subprocess.CalledProcessError) as exc:
        print(f"error: cannot read the node's GPU and NUMA layout: {exc}", file=sys.stderr)
        return 2
    if not gpus:
        print("error: nvidia-smi lists no GPU on this node", file=sys.stderr)
        return 2
    visible, problem = plan(gpus, numa, os.sched_getaffinity(0), int(local))
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    os.environ.update(CUDA_DEVICE_ORDER="PCI_BUS_ID", CUDA_VISIBLE_DEVICES=visible)
    os.execvp(command[0], command)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
