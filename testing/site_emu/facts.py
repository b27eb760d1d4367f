"""What the emulated sites are: written once, each fact with the centre page it comes from.

Nothing here is read from jobs/: the emulation is built from the centres' pages, so a job script
that departs from them fails on it. Where a value is not given by any page read (a library
version nobody checks), it says so.

Pages (as read for this emulation):
  OLCF-GUIDE   OLCF Frontier User Guide, docs.olcf.ornl.gov/systems/frontier_user_guide.html
  OLCF-CUPY    OLCF "Installing CuPy", docs.olcf.ornl.gov/software/python/cupy.html
  OLCF-PYTHON  OLCF "Python on OLCF Systems" and "Conda Basics", docs.olcf.ornl.gov/software/python/
  OLCF-TORCH   OLCF "PyTorch on Frontier", docs.olcf.ornl.gov/software/analytics/pytorch_frontier.html
  NERSC-JOBS   NERSC "Jobs", docs.nersc.gov/jobs/
  NERSC-NODES  NERSC "Node Types", docs.nersc.gov/beginner-guide/nodetypesfig
  NERSC-SCRATCH NERSC "Perlmutter Scratch", docs.nersc.gov/filesystems/perlmutter-scratch/
  ALCF-JOBS    ALCF "Running Jobs on Polaris", docs.alcf.anl.gov/polaris/running-jobs/
  ALCF-GPUS    ALCF "Using GPUs on Polaris Compute Nodes", docs.alcf.anl.gov/polaris/running-jobs/using-gpus/
  ALCF-PYTHON  ALCF "Python" (Polaris data science), docs.alcf.anl.gov/polaris/data-science/python/
  ALCF-NCCL    ALCF "NCCL" (Polaris libraries), docs.alcf.anl.gov/polaris/applications-and-libraries/libraries/nccl/
  ALCF-STORAGE ALCF "Filesystem and Storage", docs.alcf.anl.gov/data-management/filesystem-and-storage/
"""

# ---------------------------------------------------------------------------------------------
# Cray MPICH installations: version -> the compiler folder of its ofi build. The library is
# libmpi_gnu_123.so.12 in /opt/cray/pe/mpich/<version>/ofi/gnu/12.3/lib, and
# /opt/cray/pe/lib64/libmpi_gnu_123.so.12 is a link to the default version's (the and
# OLCF-GUIDE's "prepend ${MPICH_DIR}/lib" describe this layout).
MPICH_LIB = "libmpi_gnu_123.so.12"
FRONTIER_DEFAULT_MPICH = "8.1.31"   # OLCF-GUIDE: default ROCm 6.2.4 with CPE 24.11 (cray-mpich 8.1.31 in the table)
FRONTIER_CPE_MPICH = {"24.11": "8.1.31", "25.09": "9.0.1", "26.03": "9.1.0"}  # OLCF-GUIDE compatibility table
OTHER_DEFAULT_MPICH = "8.1.30"      # Perlmutter, Polaris: not from a page read; nothing depends on it
# Perlmutter's module versions below (PrgEnv-gnu/8.5.0, cudatoolkit/12.4, nccl/2.24.3, python/3.11) are
# placeholders too: NERSC's module pages were not among the stored pages read (NERSC-NODES, NERSC-JOBS,
# NERSC-SCRATCH and the introduction of docs.nersc.gov/jobs/policy/ were); jobs/setup_perlmutter.sh
# loads every module unversioned, so it takes whatever NERSC's default is.


def _mpich_dir(version):
    return f"/opt/cray/pe/mpich/{version}/ofi/gnu/12.3"


def _cray_mpich(version, default=False):
    return {"family": "mpi", "default": default,
            "setenv": {"MPICH_DIR": _mpich_dir(version), "CRAY_MPICH_DIR": _mpich_dir(version),
                       "CRAY_MPICH_VERSION": version}}


# The programming environments: PrgEnv-gnu's `cc` is GCC; PrgEnv-nvidia's is nvc (OLCF-GUIDE
# "Compilers": PrgEnv-<compiler> defines the cc/CC/ftn wrappers for that compiler).
def _prgenv(name, compiler, default=False, version=None):
    return {"family": "PrgEnv", "default": default, "setenv": {"PE_ENV": compiler.upper(), "EMU_CC": compiler}}


# ---------------------------------------------------------------------------------------------
FRONTIER = {
    "name": "frontier",
    "scheduler": "slurm",
    "login_modules": ["PrgEnv-cray", f"cray-mpich/{FRONTIER_DEFAULT_MPICH}"],
    "modules": {
        "PrgEnv-cray/8.6.0": _prgenv("PrgEnv-cray", "cray", default=True),
        "PrgEnv-gnu/8.6.0": _prgenv("PrgEnv-gnu", "gnu", default=True),
        "PrgEnv-gnu/8.7.0": _prgenv("PrgEnv-gnu", "gnu"),                       # OLCF-CUPY, OLCF-TORCH
        **{f"cray-mpich/{v}": _cray_mpich(v, default=(v == FRONTIER_DEFAULT_MPICH))
           for v in sorted(set(FRONTIER_CPE_MPICH.values()))},
        # OLCF-GUIDE "Compatibility with other CrayPE-provided Software": cpe/<YY.MM> loads the
        # release's cray-mpich; a non-default one needs CRAY_LD_LIBRARY_PATH prepended at run time
        **{f"cpe/{cpe}": {"swap": {"mpi": f"cray-mpich/{mpich}"},
                          "setenv": {"CRAY_LD_LIBRARY_PATH": f"{_mpich_dir(mpich)}/lib"}}
           for cpe, mpich in FRONTIER_CPE_MPICH.items()},
        # OLCF-GUIDE release notes: rocm/6.2.4 default; 6.4.2, 7.0.2, 7.1.1, 7.2.0 non-default
        **{f"rocm/{v}": {"family": "rocm", "default": v == "6.2.4",
                         "setenv": {"ROCM_PATH": f"/opt/rocm-{v}"}, "prepend": {"PATH": [f"/opt/rocm-{v}/bin"]}}
           for v in ("6.2.4", "6.4.2", "7.0.2", "7.1.1", "7.2.0")},
        "craype-accel-amd-gfx90a": {"setenv": {"CRAY_ACCEL_TARGET": "amd-gfx90a"}},
        # OLCF-TORCH "RCCL Network Plugin": the module configures the plugin and sets FI_CXI_RDZV_PROTO=alt_read
        "rccl-net-plugin": {"setenv": {"FI_CXI_RDZV_PROTO": "alt_read"},
                            "prepend": {"LD_LIBRARY_PATH": ["@EMU@/sw/rccl-net-plugin/lib"]},
                            "plugin": ("@EMU@/sw/rccl-net-plugin/lib", "librccl-net.so")},
        # OLCF-PYTHON "Module Usage": miniforge3/23.11.0-0 (conda; do not run conda init)
        "miniforge3/23.11.0-0": {"default": True, "conda_base": "@EMU@/sw/miniforge3/23.11.0-0"},
    },
    # OLCF-GUIDE "Common Slurm Options" and the sbatch/srun lines of OLCF-GUIDE and OLCF-TORCH
    "sbatch_options": {"-A", "-N", "-t", "-J", "-o", "-e", "-p", "-q", "-C", "-S", "-d", "--signal", "--requeue",
                       "--open-mode", "--network", "--threads-per-core", "--mail-type", "--mail-user", "--reservation"},
    "sbatch_values": {"-p": {"batch", "extended"}, "-q": {"debug", "normal"}, "--network": {"disable_rdzv_get"}},
    "srun_options": {"-N", "-n", "-c", "--ntasks-per-node", "--gpus-per-task", "--gpu-bind", "--gpus-per-node",
                     "--kill-on-bad-exit", "--cpu-bind", "--threads-per-core", "--distribution", "--ntasks-per-gpu", "-u"},
    "srun_values": {"--gpu-bind": {"closest", "none"}},
    "gpus_per_node": 8,            # OLCF-GUIDE: 8 GCDs per node, seen as 8 GPUs by Slurm
    "cpus_per_node": 56,           # OLCF-GUIDE: 64 cores, 8 reserved (-S 8 default); 1 thread per core by default
    "standin_gpu": "mi250x",
    "fs": {"/lustre/orion": "lustre"},   # OLCF-GUIDE "File Systems": Orion, Lustre with PFL
    "plugin_lib": "librccl-net.so",
}

PERLMUTTER = {
    "name": "perlmutter",
    "scheduler": "slurm",
    "login_modules": ["PrgEnv-gnu", f"cray-mpich/{OTHER_DEFAULT_MPICH}"],
    "modules": {
        "PrgEnv-gnu/8.5.0": _prgenv("PrgEnv-gnu", "gnu", default=True),
        "PrgEnv-nvidia/8.5.0": _prgenv("PrgEnv-nvidia", "nvidia", default=True),
        f"cray-mpich/{OTHER_DEFAULT_MPICH}": _cray_mpich(OTHER_DEFAULT_MPICH, default=True),
        "cudatoolkit/12.4": {"default": True, "setenv": {"CUDA_HOME": "/opt/nvidia/cuda-12.4"}},
        "craype-accel-nvidia80": {"setenv": {"CRAY_ACCEL_TARGET": "nvidia80"}},
        # the nccl module: NERSC's NCCL with the Slingshot plugin on its library path
        "nccl/2.24.3": {"default": True, "prepend": {"LD_LIBRARY_PATH": ["@EMU@/sw/nccl/lib"]},
                        "plugin": ("@EMU@/sw/nccl/lib", "libnccl-net.so")},
        "python/3.11": {"default": True, "conda_base": "@EMU@/sw/python/3.11"},
    },
    # NERSC-JOBS (sbatch, srun); -C gpu and --gpus-per-node from the job pages' GPU examples
    "sbatch_options": {"-A", "-N", "-t", "-J", "-o", "-e", "-q", "-C", "-d", "--signal", "--requeue", "--open-mode",
                       "--gpus-per-node", "-G", "--gpus", "--mail-type", "--mail-user", "--reservation"},
    "sbatch_values": {"-q": {"regular", "debug", "preempt", "shared", "premium"}, "-C": {"gpu", "cpu"}},
    "srun_options": {"-N", "-n", "-c", "--ntasks-per-node", "--cpu-bind", "--gpus-per-node", "--gpu-bind",
                     "--gpus-per-task", "-G", "--kill-on-bad-exit", "-u"},
    "srun_values": {"--gpu-bind": {"none", "closest"}, "--cpu-bind": {"cores", "threads", "none"}},
    "gpus_per_node": 4,            # NERSC-NODES: 1 AMD EPYC 7763 and 4 NVIDIA A100 per GPU node
    "cpus_per_node": 128,          # NERSC-NODES: one 64-core EPYC 7763, 2 hardware threads per core (srun -c counts them)
    "standin_gpu": "a100",
    "fs": {"/pscratch": "lustre"},  # NERSC-SCRATCH: $PSCRATCH, all-flash Lustre with PFL
    "plugin_lib": "libnccl-net.so",
}

POLARIS = {
    "name": "polaris",
    "scheduler": "pbs",
    # ALCF-PYTHON "Existing issue" and ALCF-GPUS: Cray MPICH and the NVIDIA programming environment
    "login_modules": ["PrgEnv-nvidia", f"cray-mpich/{OTHER_DEFAULT_MPICH}"],
    "modules": {
        "PrgEnv-nvidia/8.5.0": _prgenv("PrgEnv-nvidia", "nvidia", default=True),
        "PrgEnv-gnu/8.5.0": _prgenv("PrgEnv-gnu", "gnu", default=True),
        f"cray-mpich/{OTHER_DEFAULT_MPICH}": _cray_mpich(OTHER_DEFAULT_MPICH, default=True),
        "craype-accel-nvidia80": {"setenv": {"CRAY_ACCEL_TARGET": "nvidia80"}},   # ALCF-GPUS
        # ALCF-PYTHON: `module use /soft/modulefiles; module load conda; conda activate base`
        "conda/2025-09-25": {"default": True, "modulepath": "/soft/modulefiles",
                             "conda_base": "/soft/applications/conda/2025-09-25/mconda3"},
    },
    # ALCF-JOBS "Queues" (nodes, walltime) and the prod routing table
    "queues": {"debug": (1, 2, 1), "debug-scaling": (1, 10, 1), "prod": (10, 496, 24), "preemptable": (1, 10, 72),
               "demand": (1, 56, 1), "capacity": (1, 4, 168)},
    "prod_routes": [(10, 24, 3), (25, 99, 6), (100, 496, 24)],
    # ALCF-JOBS "Running MPI+OpenMP Applications": mpiexec options
    "mpiexec_options": {"-n", "--np", "-ppn", "--ppn", "--cpu-bind", "--depth", "-d", "--env", "-env", "--hostfile"},
    "mpiexec_values": {"--cpu-bind": {"depth", "core", "numa", "none"}},
    "qsub_options": {"-A", "-q", "-l", "-v", "-W", "-N", "-r", "-j", "-o", "-e", "-I", "-k", "-m", "-M"},
    "gpus_per_node": 4,            # ALCF-GPUS: 4 A100 per node
    "standin_gpu": "a100",
    "nccl_plugin_dir": "/soft/libraries/aws-ofi-nccl/v1.9.1-aws/lib",   # ALCF-NCCL
    "hwloc_dir": "/soft/libraries/hwloc/lib",                              # ALCF-NCCL
    "fs": {"/eagle": "lustre"},    # ALCF-STORAGE: /eagle, Lustre, intensive job output and large files
    "plugin_lib": "libnccl-net.so",
}

SITES = {s["name"]: s for s in (FRONTIER, PERLMUTTER, POLARIS)}

# GPU wheels the setup scripts may ask pip for: stubs that install the project's CuPy stand-in
# (testing/cupy_standin), so no multi-GB wheel is downloaded. nvidia-nccl-cu12 is a stub too: its
# presence in a venv is exactly what the one-NCCL check must refuse. cuda-toolkit (the [gpu] extra's
# source of the nvcc wheel and its crt/mma.h) is a stub of its name only.
GPU_WHEELS = {"cupy-rocm-7-0": "14.2.0", "cupy-cuda12x": "14.2.0", "nvidia-nccl-cu12": "2.32.3",
              "cuda-toolkit": "12.9.2"}
