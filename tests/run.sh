#!/usr/bin/env bash
# The whole test suite: sets itself up (.venv, install), then runs
#   1. the single-process tests (pytest), the GPU suite among them: on a real GPU when CuPy reaches
#      one, else on the CuPy stand-in and the CUDA execution harness (the header's "gpu:" line says
#      which); its multi-rank GPU runs start their own `mpiexec -n 4` under a timeout,
#   2. the MPI tests at 1, 2, 3 and 4 ranks (pytest-mpi under mpiexec, each under timeout),
#   3. the system-MPI test: boostmpi without the [mpich] extra, mpi4py built against Debian's MPICH,
#      two ranks under mpiexec.mpich (tests/integration/site/sysmpi/run_sysmpi_test.sh; the first run compiles mpi4py),
#   4. the real-Slurm test on that same system MPI,
#   5. the emulated centres: jobs/setup_<site>.sh and the job scripts end to end on emulated Frontier,
#      Perlmutter and Polaris (tests/integration/site/test_site_emu.py, testing/site_emu; root, a mount namespace, apt),
#   6. jobs/gpu_check.sh as written in an emulated fixed environment (python3 only, no .venv, no network,
#      CuPy for CUDA 13 in CUDA 13's wheel layout; tests/integration/site/test_gpu_check.py) at one GPU, four, and no MPI,
#   7. CUDA 13: a second environment, .venv-cuda13 (Python 3.12 where one is installed, cupy-cuda13x and
#      CUDA 13.0's NVRTC, runtime and crt wheels: the [test-cuda13] extra), running the header tests and
#      every NVRTC compile and resource test there (step 1 ran them on CUDA 12's wheels),
#   3 and 4 when this machine allows them (root and apt), otherwise each says why it skipped; 5 fails
#   under CI=true when it cannot run. Two lanes for a 2-core machine: the first makes .venv, then takes
#   step 1's parts (groups of test files) from a queue; the second installs the Debian packages the
#   steps need and runs steps 3, 4 and 7 meanwhile (they need no .venv), then 5 and 6, then shares the
#   parts that start no MPI job; step 2 runs after both (BOOSTMPI_CI_SERIAL=1: one lane, everything in
#   order). Every step's header says when it started, in seconds from the start (set-up included).
# Exit status is non-zero when anything failed.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
# shellcheck source=jobs/setup_env.sh
source jobs/setup_env.sh

export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
# Python's compiled modules: each compiled once, on first import, into a folder of this run (outside the
# source tree), where every later process of the run reads it, and no process compiles boostmpi again,
# as each did with PYTHONDONTWRITEBYTECODE. A process reads compiled modules only from that folder, so
# pip compiles nothing when it installs: it would compile every module of every package, about 36 s of
# CPU for .venv's 11,000 files, none of them ever read. PIP_NO_COMPILE=0 is how pip spells that:
# --no-compile stores False, and pip's documentation on configuration says such options take a false
# value from the environment (PIP_NO_COMPILE=1 turns compiling on).
unset PYTHONDONTWRITEBYTECODE
PYTHONPYCACHEPREFIX="$(mktemp -d "${TMPDIR:-/tmp}/boostmpi-ci-pycache.XXXXXX")" || exit 1
export PYTHONPYCACHEPREFIX PIP_NO_COMPILE=0
status=0
began=$SECONDS
step() { echo; echo "=== $* (at +$((SECONDS - began)) s)"; }
PYTEST_ARGS=("$@")  # tests/run.sh's own arguments go to every single-process part

# Debian's packages the steps need, installed at the start when missing (as root with apt-get), in one
# go: hipRTC (libamdhip64.so.5) and hipcc for gfx90a, Debian's ROCm 5.2, for step 1's kernel tests
# (tests/support/gpu_compilers.py; NVRTC and the real CuPy come with the [test] extra); MPICH and its
# compiler wrapper for step 3 (and step 5, whose emulated Cray MPICH is Debian's, renamed by patchelf);
# Slurm and munge for step 4. A step whose packages are missing still says why it skipped, and under
# CI=true the kernel tests and step 5 fail.
APT_PACKAGES=(hipcc libamdhip64-dev)  # with their recommends, as installed before
APT_PACKAGES_NO_RECOMMENDS=(mpich libmpich-dev patchelf slurmctld slurmd munge slurm-client)
not_installed() {  # the packages among $@ that dpkg does not have installed
  local pkg
  for pkg in "$@"; do
    dpkg-query -W -f='${Status}\n' "$pkg" 2>/dev/null | grep -q "ok installed" || echo "$pkg"
  done
}
apt_installs() {
  local missing missing_nr
  mapfile -t missing < <(not_installed "${APT_PACKAGES[@]}")
  mapfile -t missing_nr < <(not_installed "${APT_PACKAGES_NO_RECOMMENDS[@]}")
  [ $((${#missing[@]} + ${#missing_nr[@]})) -gt 0 ] || return 0
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "${missing[*]} ${missing_nr[*]}: not installed, and they cannot be here (not root, or no apt-get)"
    return 0
  fi
  echo "installing ${missing[*]} ${missing_nr[*]} with apt-get"
  _apt() {  # the lists of a fresh machine may be missing or stale: update once, then again
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" ||
      { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@"; }
  }
  if ! { { [ ${#missing[@]} -eq 0 ] || _apt "${missing[@]}"; } &&
         { [ ${#missing_nr[@]} -eq 0 ] || _apt --no-install-recommends "${missing_nr[@]}"; }; } >/tmp/boostmpi-apt.log 2>&1; then
    tail -5 /tmp/boostmpi-apt.log
    echo "apt-get could not install them (the log's end above)"
  fi
  echo "apt-get done in $((SECONDS - began)) s"
}

# Python 3.12 (what CUDA 13 nodes and PyTorch's CUDA 13 wheels run): on PATH, else pyenv's; else python3
cuda13_python() {
  local py
  for py in python3.12 "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12; do
    "$py" -c 'import venv' 2>/dev/null && { command -v "$py"; return; }
  done
  echo python3
}

# Steps 3-7 build and emulate environments (mpi4py compiled against Debian's MPICH, the emulated
# centres' set-ups, pip installing the fixed and the CUDA 13 environments): mostly compilers and pip in
# processes of their own, so they run beside steps 1-2 on a 2-core machine's second core. Steps 3, 4
# and 7 need nothing of .venv (each makes a venv of its own), so they start at once, while the first
# lane installs .venv (mostly downloads: one core would idle); steps 5 and 6 run pytest from .venv.
environment_steps_before_venv() {
  local st=0
  step "system-MPI test"
  timeout 1200 bash tests/integration/site/sysmpi/run_sysmpi_test.sh || st=1

  step "real Slurm test"
  if [ -f tests/integration/site/slurm/run_slurm_test.sh ]; then
    timeout 600 bash tests/integration/site/slurm/run_slurm_test.sh || st=1
  else
    echo "skipped: tests/integration/site/slurm/run_slurm_test.sh is not present"
  fi

  step "CUDA 13 compile tests"
  (
    started=$SECONDS
    BOOSTMPI_VENV="$PWD/.venv-cuda13" BOOSTMPI_VENV_PYTHON="$(cuda13_python)" setup_venv test-cuda13,mpich
    echo "$("$PY" -c 'import platform, numpy; print("Python", platform.python_version(), "NumPy", numpy.__version__)') in $VENV"
    # hipRTC's and hipcc's tests are step 1's: the CUDA major changes nothing there; so are the attention
    # mutations of the sm_80 budget (they test the budget check, whose reading of ptxas's report under
    # CUDA 13 every kernel's budget test here exercises)
    timeout 900 "$PY" -m pytest -q -p no:cacheprovider tests/kernels/attention/test_tensor_core_headers.py \
      tests/emulators/cudaemu/test_cudaemu_wmma.py tests/kernels/test_kernel_resources.py \
      tests/kernels/attention/test_attention_tensor_cores.py::test_nvrtc_compiles_it_within_the_budget \
      -k "not gfx90a and not hiprtc and not test_attention_mutations_fail" &&
      echo "CUDA 13 step: $((SECONDS - started)) s"
  ) || st=1
  return "$st"
}

environment_steps_with_venv() {  # $PY: .venv's python
  local st=0
  step "emulated centres"
  BOOSTMPI_SITE_EMU=1 timeout 1200 "$PY" -m pytest -q -p no:cacheprovider tests/integration/site/test_site_emu.py || st=1

  step "gpu_check in a fixed environment"
  BOOSTMPI_GPU_CHECK_EMU=1 timeout 1800 "$PY" -m pytest -q -p no:cacheprovider tests/integration/site/test_gpu_check.py || st=1
  echo
  echo "=== environment steps done (at +$((SECONDS - began)) s)"
  return "$st"
}

# Step 1 as parts in a queue: a folder or some files each, REST (every test file no other part names).
# A part is a file in $queue, taken by renaming it (atomic: two lanes never take the same part). The
# first lane takes every part, in this order; the lane of steps 3-7, once done, takes only the parts
# marked "+": none of them starts mpiexec, whose ranks poll (spin) while they wait and, beside another
# lane's work on a 2-core machine, ran 2-3x slower (bench/log/ci_time.md). So the parts that start
# MPI jobs come first, the first lane's alone, while the other lane runs steps 3-7 niced; the "+" parts
# (the longest first) come last, for both lanes. Step 2, the MPI passes, runs once both lanes are
# done, alone.
PARTS=(
  "tests/integration/test_faults.py"
  "tests/integration/gpu/test_gpu.py"
  "REST"
  "tests/kernels/attention/test_attention_tensor_cores.py"
  "tests/integration/bench/test_gpu_trace_meta.py tests/integration/site"
  "tests/emulators/cupy_standin/test_stream_order.py tests/emulators/cupy_standin/test_capture.py"
  "tests/unit/sim/test_sim.py"
  "+tests/kernels/test_kernels.py"
  "+tests/kernels/attention/test_attention_kernel.py tests/kernels/attention/test_tensor_core_headers.py tests/kernels/test_index_overflow.py tests/kernels/rmsnorm tests/kernels/adamw tests/kernels/test_kernel_resources.py"
  "+tests/integration/gpu/test_cuda_graph_train.py tests/integration/gpu/test_gemm_tensor_cores.py tests/integration/gpu/test_gpu_norm_statistic.py tests/integration/test_train.py tests/integration/test_bad_input.py"
  "+tests/test_packaging.py tests/test_docs.py tests/test_architecture.py tests/test_mirror.py tests/integration/test_paper_configs.py tests/integration/test_checkpoint.py tests/integration/test_torch_reference.py tests/unit/train tests/unit/gpu/test_cupy_routing.py tests/unit/gpu/test_attention_torch.py tests/unit/gpu/test_cublas_capture.py tests/unit/gpu/test_hipblas.py"
  "+tests/test_types.py"
  "+tests/unit/gpu/test_cupy_calls.py tests/unit/gpu/test_pools.py"
  "+tests/integration/bench/test_bench_attention.py tests/integration/bench/test_gpu_calibrate.py tests/integration/bench/test_gpu_step_graph.py tests/integration/bench/test_gpu_trace_attention.py tests/integration/bench/test_gpu_trace_step.py tests/integration/bench/test_gpu_vs_model.py tests/unit/sim/test_attention_rates.py tests/unit/sim/test_mfu.py tests/unit/sim/test_published.py tests/unit/sim/test_scale_sim.py"
  "+tests/emulators/cudaemu tests/emulators/cupy_standin/test_cupy_standin.py tests/emulators/cupy_standin/test_cupy_standin_pool.py tests/emulators/cupy_standin/test_gpu_trace_cublas.py tests/emulators/cupy_standin/test_gpu_trace_standin.py"
  "+tests/unit/checkpoint tests/unit/data"
)
queue="$(mktemp -d "${TMPDIR:-/tmp}/boostmpi-ci-queue.XXXXXX")" || exit 1
ignores=()
for part in "${PARTS[@]}"; do
  [ "$part" = REST ] || for p in ${part#+}; do ignores+=("--ignore=$p"); done
done
n_part=10
for part in "${PARTS[@]}"; do
  case "$part" in
    REST) printf 'rest tests %s\n' "${ignores[*]}" ;;
    +*) printf 'single %s\n' "${part#+}" ;;
    *) printf 'single %s\n' "$part" ;;
  esac >"$queue/part.$n_part${part//[^+]*/}"  # the name ends in "+" for a part either lane may take
  n_part=$((n_part + 1))
done

run_part() {  # $1: "single PATHS..." or "rest tests --ignore=PATH..."
  local kind="$1"; shift
  if [ "$kind" = rest ]; then step "single-process tests: every test file no other part names"
  else step "single-process tests: $*"; fi
  timeout 1500 "$PY" -m pytest -q -p no:cacheprovider --durations=8 "$@" "${PYTEST_ARGS[@]}"  # a guard against a hang
}

take_parts() {  # run parts from the queue until none is left (--shared: only those marked "+"); non-zero if any failed
  local st=0 part taken pattern="part.*"
  [ "${1:-}" = --shared ] && pattern="part.*+"
  for part in "$queue"/$pattern; do
    [ -e "$part" ] || continue
    taken="$queue/taken.${part##*/}.$BASHPID"  # out of the part.* names the other lane lists
    mv "$part" "$taken" 2>/dev/null || continue  # the other lane took it
    # shellcheck disable=SC2046
    run_part $(cat "$taken") || st=1
  done
  return "$st"
}

await_file() {  # wait until the file $1 exists
  until [ -e "$1" ]; do sleep 1; done
}
# shellcheck disable=SC2329  # called by the EXIT trap
kill_tree() {  # $1 and every process below it
  local child
  for child in $(pgrep -P "$1"); do kill_tree "$child"; done
  kill "$1" 2>/dev/null
}

# Two lanes, one per core: the second, niced, in the background: the packages, steps 3, 4 and 7, then
# (once the first lane has made .venv) steps 5 and 6, then the parts marked "+" still left. Its output
# is held in a file (printed after the first lane's, so that each step's lines stay together). The
# first lane makes .venv, waits for the packages, then takes the parts. BOOSTMPI_CI_SERIAL=1: one
# lane, everything in order (as on a 1-core machine).
ready="$(mktemp -d "${TMPDIR:-/tmp}/boostmpi-ci-ready.XXXXXX")" || exit 1  # markers: apt (done), venv (.venv's python, or "failed")
side_log="$(mktemp "${TMPDIR:-/tmp}/boostmpi-ci-env-steps.XXXXXX")" || exit 1
side=""
if [ "${BOOSTMPI_CI_SERIAL:-0}" != 1 ]; then
  # at a lower priority: the first lane's parts go first; steps 3-7 take what CPU they leave
  (renice -n 10 "$BASHPID" >/dev/null 2>&1; st=0
   step "Debian's packages"
   apt_installs; touch "$ready/apt"
   environment_steps_before_venv || st=1
   await_file "$ready/venv"
   venv_python="$(cat "$ready/venv")"
   [ "$venv_python" != failed ] || { echo "no .venv: steps 5 and 6 did not run"; exit 1; }
   PY="$venv_python" environment_steps_with_venv || st=1
   echo; echo "=== this lane now takes the parts marked + that are left (at +$((SECONDS - began)) s)"
   PY="$venv_python" take_parts --shared || st=1
   exit "$st") >"$side_log" 2>&1 &
  side=$!
  # setup_venv exits on a failure: the other lane is stopped (once apt-get is done: a dpkg stopped half-way
  # would leave the machine's packages broken) and what it did is shown
  trap 'echo failed >"$ready/venv"; await_file "$ready/apt"; kill_tree "$side"; wait "$side"; cat "$side_log"' EXIT
  echo "the packages and steps 3-7 (system MPI, Slurm, CUDA 13, then emulated centres, gpu_check) run beside"
  echo "step 1 (${#PARTS[@]} parts); that lane's output, and the parts it took after, follow this lane's; step 2"
  echo "(MPI) runs after both"
else
  step "Debian's packages"
  apt_installs
  touch "$ready/apt"
fi

setup_venv test,plot,mpich
MPIEXEC="$(boostmpi_mpiexec)" || exit 1
echo "$PY" >"$ready/venv.tmp" && mv "$ready/venv.tmp" "$ready/venv"
trap - EXIT
if [ ! -e "$ready/apt" ]; then
  echo "waiting for apt-get (the other lane) before the tests (at +$((SECONDS - began)) s)"
  await_file "$ready/apt"
fi

take_parts || status=1
echo
echo "=== this lane is done (at +$((SECONDS - began)) s)"

if [ -n "$side" ]; then
  wait "$side" || status=1
  cat "$side_log"
else
  environment_steps_before_venv || status=1
  environment_steps_with_venv || status=1
fi
rm -f "$side_log"
rm -rf "$queue" "$ready"

# Step 2: the files holding MPI tests (each marked `pytest.mark.mpi`), so that no rank collects the
# whole suite only to deselect it
mapfile -t mpi_files < <(grep -rl --include='*.py' "mark.mpi" tests | sort)
for n in 1 2 3 4; do
  step "MPI tests at $n ranks"
  timeout 600 "$MPIEXEC" -n "$n" "$PY" -m pytest -q -p no:cacheprovider --with-mpi -m mpi "${mpi_files[@]}" || status=1
done

rm -rf "$PYTHONPYCACHEPREFIX"

echo
if [ "$status" -eq 0 ]; then echo "ALL TESTS PASSED"; else echo "SOME TESTS FAILED"; fi
exit "$status"
