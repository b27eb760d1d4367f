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
#   under CI=true when it cannot run. Two lanes for a 2-core machine: steps 3-7 run beside step 1, whose
#   parts (groups of test files) the first lane takes from a queue and the second, once done with steps
#   3-7, shares where they start no MPI job; step 2 runs after both (BOOSTMPI_CI_SERIAL=1: one lane,
#   everything in order). Every part's header says when it started.
# Exit status is non-zero when anything failed.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
# shellcheck source=jobs/setup_env.sh
source jobs/setup_env.sh
setup_venv test,plot,mpich

# The GPU compilers the kernel tests compile with (tests/support/gpu_compilers.py): NVRTC and the real CuPy
# come with the [test] extra; hipRTC (libamdhip64.so.5) and hipcc for gfx90a are Debian's ROCm 5.2
# packages, installed here when missing (about a minute, as root with apt). Without them those
# tests skip, and under CI=true fail.
hip_installed() { [ "$(dpkg-query -W -f='${Status}\n' hipcc libamdhip64-dev 2>/dev/null | grep -c "ok installed")" = 2 ]; }
if ! hip_installed; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "installing hipcc libamdhip64-dev with apt-get (hipRTC and clang for gfx90a)"
    { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq hipcc libamdhip64-dev ||
      { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq hipcc libamdhip64-dev; }
    } >/tmp/boostmpi-hip-apt.log 2>&1 || { tail -5 /tmp/boostmpi-hip-apt.log; echo "apt-get could not install hipcc libamdhip64-dev"; }
  else
    echo "hipcc/libamdhip64-dev are not installed and cannot be here (not root, or no apt-get)"
  fi
fi
MPIEXEC="$(boostmpi_mpiexec)" || exit 1

export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 PYTHONDONTWRITEBYTECODE=1
status=0
began=$SECONDS
step() { echo; echo "=== $* (at +$((SECONDS - began)) s)"; }

# Python 3.12 (what CUDA 13 nodes and PyTorch's CUDA 13 wheels run): on PATH, else pyenv's; else python3
cuda13_python() {
  local py
  for py in python3.12 "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12; do
    "$py" -c 'import venv' 2>/dev/null && { command -v "$py"; return; }
  done
  echo python3
}

# Steps 3-7, which build and emulate environments (mpi4py compiled against Debian's MPICH, the emulated
# centres' set-ups, pip installing the fixed and the CUDA 13 environments): mostly compilers and pip in
# processes of their own, so they run beside steps 1-2 on a 2-core machine's second core.
environment_steps() {
  local st=0
  step "system-MPI test"
  timeout 1200 bash tests/integration/site/sysmpi/run_sysmpi_test.sh || st=1

  step "real Slurm test"
  if [ -f tests/integration/site/slurm/run_slurm_test.sh ]; then
    timeout 600 bash tests/integration/site/slurm/run_slurm_test.sh || st=1
  else
    echo "skipped: tests/integration/site/slurm/run_slurm_test.sh is not present"
  fi

  step "emulated centres"
  BOOSTMPI_SITE_EMU=1 timeout 1200 "$PY" -m pytest -q -p no:cacheprovider tests/integration/site/test_site_emu.py || st=1

  step "gpu_check in a fixed environment"
  BOOSTMPI_GPU_CHECK_EMU=1 timeout 1800 "$PY" -m pytest -q -p no:cacheprovider tests/integration/site/test_gpu_check.py || st=1

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
  echo
  echo "=== environment steps done (at +$((SECONDS - began)) s)"
  return "$st"
}

# Step 1 as parts in a queue: a folder or some files each, REST (every test file no other part names).
# A part is a file in $queue, taken by renaming it (atomic: two lanes never take the same part). The
# first lane takes every part, in this order; the lane of steps 3-7, once done, takes only the parts
# marked "+": none of them starts mpiexec, whose ranks poll (spin) while they wait and, beside another
# lane's work on a 2-core machine, ran 2-3x slower (bench/log/ci_time.md). Step 2, the MPI passes, runs
# once both lanes are done, alone.
PARTS=(
  "REST"
  "tests/integration/test_faults.py tests/integration/test_train.py tests/integration/test_bad_input.py"
  "tests/integration/gpu"
  "tests/kernels/attention tests/kernels/test_index_overflow.py tests/kernels/rmsnorm tests/kernels/adamw tests/kernels/test_kernel_resources.py"
  "tests/emulators"
  "tests/integration/bench tests/integration/site"
  "tests/unit/sim"
  "+tests/kernels/test_kernels.py"
  "+tests/test_types.py"
  "+tests/unit/gpu/test_cupy_calls.py tests/unit/gpu/test_pools.py"
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
PYTEST_ARGS=("$@")  # tests/run.sh's own arguments go to every single-process part

# Two lanes, one per core: steps 3-7 in the background, niced, then the parts marked "+" still left,
# their output held in a file (printed after the first lane's, so that each step's lines stay
# together), unless BOOSTMPI_CI_SERIAL=1 (one lane, as on a 1-core machine).
side_log="$(mktemp "${TMPDIR:-/tmp}/boostmpi-ci-env-steps.XXXXXX")" || exit 1
side=""
if [ "${BOOSTMPI_CI_SERIAL:-0}" != 1 ]; then
  # at a lower priority: the first lane's parts go first; steps 3-7 take what CPU they leave
  (renice -n 10 "$BASHPID" >/dev/null 2>&1; st=0; environment_steps || st=1
   echo; echo "=== this lane now takes the parts marked + that are left (at +$((SECONDS - began)) s)"
   take_parts --shared || st=1
   exit "$st") >"$side_log" 2>&1 &
  side=$!
  echo "steps 3-7 (system MPI, Slurm, emulated centres, gpu_check, CUDA 13) run beside step 1 (${#PARTS[@]} parts); that"
  echo "lane's output, and the parts it took after, follow this lane's; step 2 (MPI) runs after both"
fi

take_parts || status=1
echo
echo "=== this lane is done (at +$((SECONDS - began)) s)"

if [ -n "$side" ]; then
  wait "$side" || status=1
  cat "$side_log"
else
  environment_steps || status=1
fi
rm -f "$side_log"
rm -rf "$queue"

# Step 2: the files holding MPI tests (each marked `pytest.mark.mpi`), so that no rank collects the
# whole suite only to deselect it
mapfile -t mpi_files < <(grep -rl --include='*.py' "mark.mpi" tests | sort)
for n in 1 2 3 4; do
  step "MPI tests at $n ranks"
  timeout 600 "$MPIEXEC" -n "$n" "$PY" -m pytest -q -p no:cacheprovider --with-mpi -m mpi "${mpi_files[@]}" || status=1
done

echo
if [ "$status" -eq 0 ]; then echo "ALL TESTS PASSED"; else echo "SOME TESTS FAILED"; fi
exit "$status"
