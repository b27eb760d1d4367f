"""tests/ mirrors the package, and its conftest.py acts only through hooks and fixtures.

tests/ mirrors the package: every module boostmpi/<package>/<module>.py has its unit tests in
tests/unit/<package>/test_<module>.py (boostmpi/<module>.py: tests/unit/core/test_<module>.py), or an entry
below saying where its tests are instead and why. A new module without either fails here."""

import os
import re
import subprocess
import sys
from pathlib import Path

import boostmpi

PACKAGE = Path(boostmpi.__file__).parent
REPO = PACKAGE.parent

# module (relative to boostmpi/) -> why it has no tests/unit/<package>/test_<module>.py, naming the tests that cover it
EXEMPT = {
    "__main__.py": "`python -m boostmpi`: two lines calling cli.main, whose commands the CLI tests run "
                   "(tests/integration/test_bad_input.py)",
    "arrays.py": "the array type alias of the annotations: no behaviour to test",
    "cli.py": "the command line, run end to end by tests/integration/test_bad_input.py and tests/unit/parallel/test_startup.py",
    "errors.py": "the one-line refusals, checked wherever a refusal is (tests/integration/test_bad_input.py)",
    "files.py": "filesystem failures injected in tests/integration/test_faults.py",
    "toml_io.py": "TOML read and written through the configuration: bad files and the round trip of every value "
                  "type in tests/unit/core/test_config.py, machine profiles in tests/unit/sim/test_sim.py",
    "checkpoint/format.py": "the on-disk layout, written and read back in tests/unit/checkpoint/test_checkpoint_io.py",
    "checkpoint/held.py": "held checkpoints against pruning: tests/unit/checkpoint/test_reading_live.py",
    "checkpoint/layout.py": "tests/unit/checkpoint/test_checkpoint_io.py and, across layouts, "
                            "tests/integration/test_checkpoint_parallel.py",
    "checkpoint/pins.py": "readers' pins while a run prunes: tests/unit/checkpoint/test_reading_live.py",
    "checkpoint/reading.py": "tests/unit/checkpoint/test_checkpoint_io.py, tests/unit/checkpoint/test_reading_live.py",
    "checkpoint/runs.py": "tests/unit/checkpoint/test_checkpoint_io.py and the resume tests of "
                          "tests/integration/test_checkpoint.py",
    "checkpoint/saving.py": "tests/integration/test_checkpoint.py and the injected failures of tests/integration/test_faults.py",
    "checkpoint/writer.py": "tests/unit/checkpoint/test_checkpoint_io.py, tests/integration/test_faults.py",
    "data/corpus.py": "tests/unit/data/test_data.py",
    "data/prepare.py": "`boostmpi data`, run by tests/unit/data/test_data.py",
    "data/progress.py": "tests/unit/data/test_data.py",
    "data/shards.py": "tests/unit/data/test_data.py, tests/unit/data/test_shuffle.py, tests/unit/data/test_resume_settings.py",
    "data/tokenizer.py": "tests/unit/data/test_data.py",
    "gpu/adamw_kernels.py": "kernels/adamw.cu's wrappers: tests/kernels/adamw/test_adamw_kernel.py",
    "gpu/arguments.py": "the kernels' argument checks, through their wrappers in tests/kernels/test_kernels.py and "
                        "tests/unit/gpu/test_cupy_routing.py",
    "gpu/attention.py": "the attention backend seam: tests/unit/gpu/test_attention_cudnn.py, "
                        "tests/unit/gpu/test_attention_torch.py",
    "gpu/blas.py": "tests/unit/gpu/test_cupy_routing.py, tests/integration/gpu/test_gemm_tensor_cores.py",
    "gpu/kernels.py": "the kernel wrappers, one folder of tests per kernel file: tests/kernels/",
    "gpu/launch_plan.py": "the kernels' tile sizes, tested with the kernels they compile into: a changed plan and "
                          "plans the kernels cannot run in tests/kernels/attention/test_attention_kernel.py",
    "gpu/ranges.py": "NVTX ranges, read by the trace in tests/emulators/cupy_standin/test_gpu_trace_standin.py",
    "gpu/tensor_cores.py": "tests/kernels/attention/test_attention_tensor_cores.py, "
                           "tests/kernels/attention/test_tensor_core_headers.py",
    "model/transformer.py": "whole steps against PyTorch (tests/unit/model/test_model_grads.py) and across layouts "
                            "(tests/integration/test_parallel.py)",
    "parallel/comm.py": "tests/unit/parallel/test_host_collectives.py and the byte counts of tests/integration/test_parallel.py",
    "parallel/data_parallel.py": "tests/integration/test_parallel.py (dp layouts, ZeRO-1), tests/unit/parallel/test_pipeline.py",
    "parallel/engine.py": "tests/integration/test_parallel.py, tests/integration/test_interleaved.py, "
                          "tests/unit/parallel/test_pipelined_eval.py",
    "parallel/grid.py": "tests/unit/model/test_layers.py, tests/integration/test_parallel.py",
    "parallel/launch.py": "tests/integration/site/test_jobs.py, tests/unit/sim/test_sim.py",
    "parallel/tensor_parallel/base.py": "the strategies' shared part, run by every tp layout of tests/integration/test_parallel.py",
    "parallel/tensor_parallel/btp.py": "tests/integration/test_parallel.py, tests/integration/gpu/test_gpu_norm_statistic.py",
    "parallel/tensor_parallel/megatron.py": "the megatron layouts of tests/integration/test_parallel.py",
    "parallel/tensor_parallel/vanilla.py": "the vanilla layouts of tests/integration/test_parallel.py",
    "parallel/vocab_parallel.py": "tests/integration/test_parallel.py, tests/kernels/test_kernels.py",
    "sim/calibrate.py": "tests/unit/sim/test_sim.py, tests/integration/bench/test_gpu_calibrate.py",
    "sim/cli.py": "`boostmpi sim`, run by tests/unit/sim/test_sim.py and tests/unit/sim/test_published.py",
    "sim/costs.py": "tests/unit/sim/test_sim.py, tests/unit/sim/test_published.py",
    "sim/machines.py": "tests/unit/sim/test_sim.py, tests/unit/sim/test_mfu.py",
    "sim/memory.py": "tests/unit/sim/test_sim.py, tests/unit/parallel/test_startup.py",
    "sim/model.py": "tests/unit/sim/test_sim.py, tests/unit/sim/test_published.py, tests/integration/test_sim_vs_engine.py",
    "sim/plans.py": "tests/unit/sim/test_sim.py, tests/unit/model/test_recompute.py",
    "sim/operations.py": "the operations and shape the plans are written in, priced and counted in tests/unit/sim/test_sim.py "
                  "(FlashAttention-2's traffic, the launches of a plan) and tests/unit/sim/test_published.py",
    "sim/sweep.py": "tests/unit/sim/test_sim.py, tests/unit/sim/test_published.py",
    "sim/trace.py": "tests/unit/sim/test_sim.py, tests/integration/bench/test_gpu_trace_attention.py",
    "tools/evaluate.py": "tests/unit/tools/test_tools.py, tests/integration/test_interleaved.py",
    "tools/export.py": "`boostmpi export`, run by tests/unit/tools/test_tools.py",
    "tools/generate.py": "tests/unit/tools/test_tools.py",
    "tools/inspect.py": "tests/unit/tools/test_tools.py",
    "tools/loading.py": "tests/unit/tools/test_tools.py",
    "tools/plot.py": "tests/unit/tools/test_tools.py",
    "train/cli.py": "`boostmpi train`, run by tests/integration/test_train.py and tests/unit/parallel/test_startup.py",
    "train/resume.py": "tests/unit/data/test_resume_settings.py, tests/integration/test_resume_layouts.py",
    "train/trainer.py": "tests/integration/test_train.py, tests/integration/test_checkpoint.py, tests/integration/test_faults.py",
}


def modules():
    return sorted(p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py") if p.name != "__init__.py")


def unit_test_of(module):
    """tests/unit/<package>/test_<module>.py for boostmpi/<package>/<module>.py; core/ for boostmpi/<module>.py."""
    path = Path(module)
    folder = path.parent.as_posix() if path.parent != Path(".") else "core"
    return Path("tests") / "unit" / folder / f"test_{path.stem}.py"


def unmapped(names, exempt):
    return [m for m in names if not (REPO / unit_test_of(m)).exists() and m not in exempt]


def test_every_module_has_its_unit_test_file_or_an_exemption():
    missing = unmapped(modules(), EXEMPT)
    assert not missing, ("modules with neither tests/unit/<package>/test_<module>.py nor an entry in "
                         f"tests/test_mirror.py's EXEMPT: {[f'{m} -> {unit_test_of(m)}' for m in missing]}")


def test_a_new_module_without_either_is_caught():
    assert unmapped(modules() + ["gpu/no_such_module.py"], EXEMPT) == ["gpu/no_such_module.py"]
    assert unmapped(["train/trainer.py"], {}) == ["train/trainer.py"]
    assert unit_test_of("files.py") == Path("tests/unit/core/test_files.py")
    assert unit_test_of("parallel/tensor_parallel/btp.py") == Path("tests/unit/parallel/tensor_parallel/test_btp.py")


def test_every_exemption_is_of_a_module_without_its_test_file_and_names_tests_that_exist():
    names = set(modules())
    stale = [m for m in EXEMPT if m not in names or (REPO / unit_test_of(m)).exists()]
    assert not stale, f"EXEMPT entries for modules that are gone or have their own test file now: {stale}"
    named = {m: re.findall(r"tests/[\w/]+(?:\.py|/)", reason) for m, reason in EXEMPT.items()}
    wrong = {m: p for m, paths in named.items() for p in paths if not (REPO / p).exists()}
    assert not wrong, f"EXEMPT reasons naming files that do not exist: {wrong}"


def test_importing_conftest_does_nothing():
    """No CuPy choice, no boostmpi, no environment variable until pytest calls conftest's hooks."""
    code = ("import os, sys, tests.conftest\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('cupy', 'boostmpi', 'mpi4py')),\n"
            "      sorted(k for k in os.environ if k.startswith('BOOSTMPI_')), os.environ.get('PYTHONPATH'))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("BOOSTMPI_") and k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[]", "[]", "None"], out.stdout
