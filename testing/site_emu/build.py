"""Build an emulated site under a temporary root, and run commands on it.

    site = EmulatedSite.create("perlmutter", root, cache)   # the tree below
    site.login("bash jobs/setup_perlmutter.sh")             # a login shell on the site, in the repo copy

Everything lives below `root` (and the shared `cache`: the wheelhouse and the mpi4py wheels; the
CUDA harness compiles into the host's own compile cache). Commands run in a private mount namespace,
chrooted into root/fs, where the host's top-level folders are bound in and /opt/cray, /soft and the
site's parallel file system (/lustre/orion, /pscratch, /eagle) come from root: nothing else is
written outside root and cache.

    root/repo          a copy of the repository (tests may change it: a mutation is a change here)
    root/cray          /opt/cray: pe/mpich/<version>/ofi/gnu/12.3/{lib,include}, pe/lib64 (links to the
                       default version's library), pe/craype/default/bin/cc, pals/1.4/bin/mpiexec (Polaris)
    root/soft          /soft (Polaris): modulefiles, applications/conda (the conda base), libraries/aws-ofi-nccl
    root/sw            other site software: the conda/python bases, the NCCL/RCCL network plugins
    root/emu           the emulated commands and site.json (the facts of testing/site_emu/facts.py)
    root/home/user     $HOME; .bash_profile sets up `module` as the site's login does
    root/log           module.log (every load), cc.log, srun.log, mpiexec.log
    root/sched         the scheduler's jobs
    root/pycache       the compiled modules of the site's login sessions and Slurm jobs (PYTHONPYCACHEPREFIX;
                       a PBS job starts from PBS's own environment without it and compiles next to the sources)

The MPI is Debian's MPICH (apt-get install mpich libmpich-dev): each Cray MPICH version's
libmpi_gnu_123.so.12 is a copy of libmpich.so.12 whose soname is set to that name (patchelf), so a
program linked by `cc` loads it by the Cray name through the library path, as on the machines.
/opt/cray/pe/lib64 stands in for /etc/ld.so.conf.d/cray-pe.conf: the login environment ends
LD_LIBRARY_PATH with it (the loader searches it after LD_LIBRARY_PATH's other entries).
"""

import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

from testing import cudaemu
from testing.site_emu import facts

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
DEBIAN_MPICH = Path("/usr/lib/x86_64-linux-gnu/libmpich.so.12")
DEBIAN_MPICH_INCLUDE = Path("/usr/include/x86_64-linux-gnu/mpich")
EMU_TOOLS = ["module.py", "conda.py", "nvc.py", "ranks.py", "srun.py", "sched.py", "pals_mpiexec.py", "nvidia_smi.py"]
WHEELHOUSE_PACKAGES = ["numpy", "h5py", "xxhash", "ml_dtypes", "setuptools>=64", "wheel", "build", "cython>=3.0.1"]
# the stand-in's PCI bus ids of an A100 node (testing/cupy_standin/cupy/cuda/runtime.py), and the
# NUMA node each GPU hangs off in the emulated Perlmutter node: reversed, so that GPU 3 is nearest the
# first cores (a layout where "local rank r takes GPU r" is wrong). The node has 4 NUMA nodes, each
# with one of this machine's CPUs where it has them.
A100_BUS_IDS = ["0000:07:00.0", "0000:47:00.0", "0000:87:00.0", "0000:c7:00.0"]
PERLMUTTER_GPU_NUMA = [3, 2, 1, 0]


# Python's own compile flags (what mpi4py's build passes the MPI compiler, GCC-only ones among them:
# -fwrapv, -Wsign-compare), at -O0: mpi4py compiles in a third of the time; the flags nvc must refuse stay
PYTHON_CFLAGS_O0 = re.sub(r"-O[0-9s]?", "-O0", sysconfig.get_config_var("CFLAGS") or "-O0")


def kill_group(proc):
    """SIGKILL the process group that `proc` leads (the emulated site's processes of one call)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run(cmd, **kw):
    return subprocess.run(cmd, check=True, **kw)


def prepare_cache(cache):
    """The shared wheelhouse (the packages the setup scripts install, the mpi4py source, stub GPU
    wheels) and the folders of the per-MPI mpi4py wheels and of pip. Once per session."""
    cache = Path(cache)
    wheels = cache / "wheels"
    if not (wheels / ".complete").exists():
        wheels.mkdir(parents=True, exist_ok=True)
        pip = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "-d", str(wheels)]
        run(pip + WHEELHOUSE_PACKAGES)
        run(pip + ["--no-binary", "mpi4py", "--no-deps", "mpi4py>=3.1"])
        cythonize_mpi4py_sdist(wheels)
        for name, version in facts.GPU_WHEELS.items():
            stub_wheel(wheels, name, version)
        (wheels / ".complete").write_text("")
    for sub in ("mpi4py-wheels", "pip"):
        (cache / sub).mkdir(exist_ok=True)
    return cache


def cythonize_mpi4py_sdist(wheels):
    """Put mpi4py's Cython output (src/mpi4py/MPI.c) into its sdist in the wheelhouse, generated once.

    The C that Cython writes from MPI.pyx does not depend on the MPI (that is decided when the C is
    compiled), and mpi4py's build skips Cython when the C file is newer than its sources (conf/
    mpidistutils.py, cython_run). So every per-MPI build on the emulated sites still configures,
    compiles and links mpi4py with the site's compiler wrapper against the site's MPI, and none
    spends its first half running Cython again on the same sources. The result is kept in this
    machine's cache (a pure function of the sdist's bytes and the Cython wheel), so the next session
    copies it instead of running Cython for about 25 s."""
    (sdist,) = wheels.glob("mpi4py-*.tar.gz")
    (cython_wheel,) = wheels.glob("[Cc]ython-*.whl")
    key = hashlib.sha256(sdist.read_bytes() + cython_wheel.name.encode()).hexdigest()[:24]
    kept = cudaemu.cache_dir().parent / "boostmpi-site-emu" / f"{sdist.name[:-len('.tar.gz')]}-cythonized-{key}.tar.gz"
    if kept.is_file():
        shutil.copyfile(kept, sdist)
        return
    work, cython = wheels.parent / "mpi4py-sdist", wheels.parent / "cython"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    with tarfile.open(sdist) as t:
        t.extractall(work, filter="data")
    (top,) = work.iterdir()
    run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-index",
         "--find-links", str(wheels), "--target", str(cython), "cython>=3.0.1"])
    run([sys.executable, "conf/cythonize.py", "src/mpi4py/MPI.pyx", "--output-file", "src/mpi4py/MPI.c"],
        cwd=top, env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(cython), str(top / "conf")])))
    with tarfile.open(sdist, "w:gz", compresslevel=1) as t:
        t.add(top, arcname=top.name)
    shutil.rmtree(work)
    kept.parent.mkdir(parents=True, exist_ok=True)
    partial = kept.with_name(f"{kept.name}.{os.getpid()}.partial")
    shutil.copyfile(sdist, partial)
    partial.replace(kept)  # whole or absent: a run stopped half-way leaves no half file under the name


def stub_wheel(folder, name, version):
    """A wheel NAME==VERSION without the real library: a CuPy wheel installs the project's CuPy
    stand-in (testing/cupy_standin/cupy and cupyx, as the real wheel ships both) and its CUDA
    execution harness (testing/cudaemu, installed as the package testing.cudaemu) instead; an
    NCCL wheel installs only its name, which is what the one-NCCL check looks for."""
    dist = name.replace("-", "_")
    files = {f"{dist}-{version}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                                                     f"Summary: emulation stub (no library)\n",
             f"{dist}-{version}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: site_emu\nRoot-Is-Purelib: true\n"
                                                  "Tag: py3-none-any\n"}
    if name.startswith("cupy"):
        testing = REPO / "testing"  # cupy and cupyx at the top, the harness as testing.cudaemu (as the stand-in imports it)
        files["testing/__init__.py"] = (testing / "__init__.py").read_text()
        for package, base in ((testing / "cupy_standin" / "cupy", testing / "cupy_standin"),
                              (testing / "cupy_standin" / "cupyx", testing / "cupy_standin"), (testing / "cudaemu", REPO)):
            for path in sorted(package.rglob("*")):
                if path.is_file() and "__pycache__" not in path.parts:
                    files[str(path.relative_to(base))] = path.read_text()
    record = f"{dist}-{version}.dist-info/RECORD"
    files[record] = "".join(f"{path},,\n" for path in files) + f"{record},,\n"
    with zipfile.ZipFile(Path(folder) / f"{dist}-{version}-py3-none-any.whl", "w") as z:
        for path, text in files.items():
            z.writestr(path, text)


def _write(path, text, mode=0o644):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(mode)


def real_prefix(prefix):
    """A Python installation at `prefix` that is its own sys.prefix (not a venv): a copy of this
    machine's base interpreter binary beside links to every entry of its standard library except
    site-packages, so the prefix has a site-packages of its own, empty. Python finds its prefix from
    the landmark lib/pythonX.Y/os.py next to the (copied, not linked) executable."""
    prefix = Path(prefix)
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    stdlib = Path(sysconfig.get_path("stdlib"))
    (prefix / "bin").mkdir(parents=True, exist_ok=True)
    shutil.copy2(Path(sys.base_prefix) / "bin" / version, prefix / "bin" / version)
    for name in ("python3", "python"):
        (prefix / "bin" / name).symlink_to(version)
    lib = prefix / "lib" / version
    (lib / "site-packages").mkdir(parents=True, exist_ok=True)
    for entry in stdlib.iterdir():
        if entry.name != "site-packages":
            (lib / entry.name).symlink_to(entry)


def _plugin(lib_dir, name):
    """A real shared library named like the network plugin: the loader opens it, as NCCL would."""
    lib_dir = Path(lib_dir)
    lib_dir.mkdir(parents=True, exist_ok=True)
    src = lib_dir / "plugin.c"
    src.write_text("int emulated_net_plugin_v1(void) { return 1; }\n")
    run(["gcc", "-shared", "-fPIC", "-o", str(lib_dir / name), str(src)])
    src.unlink()


class EmulatedSite:
    def __init__(self, name, root, cache):
        self.name, self.root, self.cache = name, Path(root), Path(cache)
        self.facts = facts.SITES[name]
        self.repo = self.root / "repo"
        self.home = self.root / "home" / "user"

    # ------------------------------------------------------------------ building
    @classmethod
    def create(cls, name, root, cache):
        site = cls(name, root, cache)
        site._tree()
        return site

    def _tree(self):
        r = self.root
        for sub in ("emu/bin", "log", "sched", "slurm", "pbs", "tmp", "cray", "soft/modulefiles", "sw", "lustre/orion",
                    "pscratch/sd/u/user", "eagle/proj", "fs"):
            (r / sub).mkdir(parents=True, exist_ok=True)
        self.home.mkdir(parents=True, exist_ok=True)
        # the repository, as a user's clone
        files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, check=True, capture_output=True).stdout.split(b"\0")
        for rel in filter(None, files):
            src, dst = REPO / rel.decode(), self.repo / rel.decode()
            if src.is_file():
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dst)
        # the facts and the emulated commands
        site = {k: (sorted(v) if isinstance(v, set) else v) for k, v in self.facts.items()}
        site = json.loads(json.dumps(site, default=sorted))
        _write(r / "emu" / "site.json", json.dumps(site, indent=1))
        for tool in EMU_TOOLS:
            shutil.copy2(HERE / tool, r / "emu" / tool)
        py = sys.executable
        wrapper = '#!/bin/bash\nexec {py} {root}/emu/{tool} "$@"\n'
        sched = '#!/bin/bash\nexec {py} {root}/emu/sched.py {cmd} "$@"\n'
        for cmd, tool in (("srun", "srun.py"), ("nvidia-smi", "nvidia_smi.py")):
            _write(r / "emu" / "bin" / cmd, wrapper.format(py=py, root=r, tool=tool), 0o755)
        for cmd in ("sbatch", "scontrol", "qsub", "qstat"):
            _write(r / "emu" / "bin" / cmd, sched.format(py=py, root=r, cmd=cmd), 0o755)
        # Cray PE: MPICH versions, the lib64 link farm, the compiler wrapper
        versions = sorted({spec["setenv"]["CRAY_MPICH_VERSION"] for spec in self.facts["modules"].values()
                           if "CRAY_MPICH_VERSION" in spec.get("setenv", {})})
        default = next(spec["setenv"]["CRAY_MPICH_VERSION"] for spec in self.facts["modules"].values()
                       if spec.get("family") == "mpi" and spec.get("default"))
        for version in versions:
            lib = r / "cray" / "pe" / "mpich" / version / "ofi" / "gnu" / "12.3" / "lib"
            lib.mkdir(parents=True, exist_ok=True)
            target = lib / facts.MPICH_LIB
            shutil.copy2(DEBIAN_MPICH.resolve(), target)
            run(["patchelf", "--set-soname", facts.MPICH_LIB, str(target)])
            (lib / "libmpi_gnu_123.so").symlink_to(facts.MPICH_LIB)
            (lib.parent / "include").symlink_to(DEBIAN_MPICH_INCLUDE)
        lib64 = r / "cray" / "pe" / "lib64"
        lib64.mkdir(parents=True, exist_ok=True)
        (lib64 / facts.MPICH_LIB).symlink_to(f"/opt/cray/pe/mpich/{default}/ofi/gnu/12.3/lib/{facts.MPICH_LIB}")
        _write(r / "cray" / "pe" / "craype" / "default" / "bin" / "cc", (HERE / "cc").read_text(), 0o755)
        _write(r / "emu" / "nvc.py", (HERE / "nvc.py").read_text())
        if self.name == "polaris":
            _write(r / "cray" / "pals" / "1.4" / "bin" / "mpiexec",
                   wrapper.format(py=py, root=r, tool="pals_mpiexec.py"), 0o755)
        # conda / python bases, network plugins, the node
        for spec in self.facts["modules"].values():
            base = spec.get("conda_base")
            if base and "@EMU@" in base:
                self._base(Path(base.replace("@EMU@", str(r))), venv=False)
            plugin = spec.get("plugin")
            if plugin:
                _plugin(plugin[0].replace("@EMU@", str(r)), plugin[1])
        if self.name == "polaris":
            _plugin(r / "soft" / "libraries" / "aws-ofi-nccl" / "v1.9.1-aws" / "lib", "libnccl-net.so")
            (r / "soft" / "libraries" / "hwloc" / "lib").mkdir(parents=True, exist_ok=True)
        gpus = A100_BUS_IDS if self.facts["standin_gpu"] == "a100" else []
        _write(r / "emu" / "node.json", json.dumps({"gpus": gpus}))
        sysfs = r / "sysfs"
        ncpu = os.cpu_count() or 1
        for node in range(4):
            _write(sysfs / "devices" / "system" / "node" / f"node{node}" / "cpulist", f"{node}\n" if node < ncpu else "\n")
        for bus, node in zip(A100_BUS_IDS, PERLMUTTER_GPU_NUMA):
            _write(sysfs / "bus" / "pci" / "devices" / bus / "numa_node", f"{node}\n")
        self._login_files()

    def _base(self, base, venv):
        """A conda base environment: bin/python3 (this machine's Python, or a venv of it), and an
        activation script that reads a variable which may be unset, as package activation scripts do."""
        base.mkdir(parents=True, exist_ok=True)
        if venv:
            run([sys.executable, "-m", "venv", str(base)])
        else:
            (base / "bin").mkdir(exist_ok=True)
            for name in ("python3", "python"):
                if not (base / "bin" / name).exists():
                    (base / "bin" / name).symlink_to(sys.executable)
        _write(base / "etc" / "conda" / "activate.d" / "emulated-compiler.sh",
               '# like a compiler package activation script: reads a variable that is usually unset\n'
               'if [ -n "$CONDA_BUILD" ]; then export CC_FOR_BUILD="$CC"; fi\n')

    def _login_files(self):
        r, f = self.root, self.facts
        path = [str(r / "emu" / "bin"), "/opt/cray/pe/craype/default/bin"]
        if self.name == "polaris":
            path.append("/opt/cray/pals/1.4/bin")
        login = f"""# the login environment of the emulated {self.name}: `module`, the default modules, Cray's PATH
export EMU_ROOT={shlex.quote(str(r))} EMU_PYTHON={shlex.quote(sys.executable)} EMU_SITE={self.name}
export EMU_REPO={shlex.quote(str(self.repo))}
module() {{ eval "$("$EMU_PYTHON" "$EMU_ROOT/emu/module.py" "$@")"; }}
export -f module
case ":$PATH:" in *":{path[0]}:"*) ;; *) export PATH={':'.join(path)}:"$PATH" ;; esac
case ":${{LD_LIBRARY_PATH:-}}:" in *":/opt/cray/pe/lib64:"*) ;; *) export LD_LIBRARY_PATH="${{LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}}/opt/cray/pe/lib64" ;; esac
[ -n "${{LOADEDMODULES:-}}" ] || module load {' '.join(f['login_modules'])}
"""
        _write(r / "emu" / "login.sh", login)
        _write(self.home / ".bash_profile", f". {shlex.quote(str(r / 'emu' / 'login.sh'))}\n")

    # ------------------------------------------------------------------ running
    def environment(self, **extra):
        """The variables of a user's session on the site (before the login profile runs)."""
        env = {"HOME": str(self.home), "USER": "user", "LOGNAME": "user", "PATH": "/usr/bin:/bin",
               "TMPDIR": str(self.root / "tmp"), "LANG": "C.UTF-8", "SHELL": "/bin/bash",
               "PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(self.cache / "wheels"),
               "PIP_CACHE_DIR": str(self.cache / "pip"), "PIP_DISABLE_PIP_VERSION_CHECK": "1",
               "BOOSTMPI_MPI4PY_WHEELHOUSE": str(self.cache / "mpi4py-wheels"), "CFLAGS": PYTHON_CFLAGS_O0,
               # the harness's compile cache is the host's (content-addressed: a site compiles what a test
               # already did, or the last run, only once)
               "BOOSTMPI_CUDAEMU_CACHE": str(cudaemu.cache_dir()), "BOOSTMPI_CUPY_STANDIN": "1",
               "BOOSTMPI_STANDIN_GPU": self.facts["standin_gpu"],
               # compiled modules in a folder of the site (every later process of a session reads them),
               # so pip compiles nothing it installs (PIP_NO_COMPILE=0: pip reads its --no-compile inverted)
               "PYTHONPYCACHEPREFIX": str(self.root / "pycache"), "PIP_NO_COMPILE": "0",
               "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
        if self.name == "perlmutter":
            env.update(BOOSTMPI_SYSFS=str(self.root / "sysfs"), PSCRATCH="/pscratch/sd/u/user")
        env.update(extra)
        return env

    def login(self, script, timeout=600, **extra):
        """Run `script` (bash) in a login shell of the site, from the repository copy."""
        body = f"cd {shlex.quote(str(self.repo))} && {script}"
        return self.enter(["/bin/bash", "-l", "-c", body], self.environment(**extra), timeout)

    def _command(self, argv, env):
        return ["unshare", "-m", "--propagation", "private", "--", "/bin/bash", str(HERE / "enter.sh"), str(self.root),
                "/usr/bin/env", "-i", *[f"{k}={v}" for k, v in env.items()], *argv]

    def enter(self, argv, env, timeout=600):
        """Run argv on the site; on a timeout every process it started is killed (its process group)."""
        proc = subprocess.Popen(self._command(argv, env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            out, _ = proc.communicate()
            out += f"\n[site_emu: killed after {timeout} s]"
        return subprocess.CompletedProcess(argv, proc.returncode, out)

    def enter_async(self, argv, **extra):
        """Popen of argv on the site (a login session's variables plus `extra`), in its own process group
        (kill_group ends all of it)."""
        return subprocess.Popen(self._command(argv, self.environment(**extra)), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, cwd=self.repo, start_new_session=True)

    def polaris_base(self):
        """ALCF's conda base on the emulated Polaris: a Python environment with numpy, h5py and
        mpi4py built against the site's Cray MPICH (by cc under PrgEnv-gnu, once, into the wheelhouse).

        Like a conda environment it is a prefix of its own, not a venv (`real_prefix`): a venv made
        from it with --system-site-packages, as ALCF's Python page makes one, sees its packages
        (a venv made from a venv would see this machine's Python's instead)."""
        base = "/soft/applications/conda/2025-09-25/mconda3"
        real_prefix(self.root / base.lstrip("/"))  # root/soft is the site's /soft
        script = f"""set -e
module swap PrgEnv-nvidia PrgEnv-gnu
{base}/bin/python -m ensurepip > /dev/null
{base}/bin/python -m pip install -q numpy h5py
export PY={base}/bin/python
. jobs/setup_env.sh
install_mpi4py_from_source "cc -shared"
"""
        p = self.login(script, timeout=900)
        if p.returncode == 0:
            self._base(self.root / "soft" / "applications" / "conda" / "2025-09-25" / "mconda3", venv=False)
        return p

    def log(self, name):
        path = self.root / "log" / name
        return path.read_text() if path.exists() else ""
