"""boostmpi/precision.py answers every dtype question, and the table in its docstring (what a reader
of the code sees first) says what the functions return; a mutant of the functions' text is caught."""

import inspect
import re

import ml_dtypes
import numpy as np
import pytest

from boostmpi import precision
from boostmpi.errors import UserError
from boostmpi.parallel import comm


def compute_on_this_machine(name):
    """The compute dtype, with bfloat16 taken as the GPU would (no GPU here: ml_dtypes' type)."""
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(precision.compute_dtype(name))


def answers(p):
    """{row label: [dtype name for float64, float32, bfloat16]} as module `p` computes them."""
    rows = {}
    for name in precision.NAMES:
        c = compute_on_this_machine(name)
        got = {"master_dtype": np.dtype(p.master_dtype(name)), "compute_dtype": c,
               "statistic_dtype": np.dtype(p.statistic_dtype(c)),
               "mpi_sum_dtype": np.dtype(p.mpi_sum_dtype(c, comm._mpi_knows(c))),
               "cpu_dtype_name": np.dtype(p.cpu_dtype_name(name))}
        for key, dtype in got.items():
            rows.setdefault(key, []).append(dtype.name)
    return rows


def documented():
    """The same, read from the table in precision's docstring."""
    rows = {}
    for line in precision.__doc__.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[4].startswith("`"):
            rows[cells[4].strip("`")] = cells[1:4]
    return rows


def test_the_docstring_table_is_what_the_functions_answer():
    assert answers(precision) == documented()


def test_the_mutant_that_keeps_float64_masters_in_float32_is_caught():
    source = inspect.getsource(precision)
    real = 'return np.float64 if name == "float64" else np.float32'
    assert source.count(real) == 1
    namespace = {}
    exec(compile(source.replace(real, "return np.float32"), precision.__file__, "exec"), namespace)
    mutant = type("Mutant", (), {k: staticmethod(v) for k, v in namespace.items() if callable(v)})
    assert answers(mutant) != documented()


def test_bfloat16_on_the_cpu_is_one_line():
    assert precision.device_problem("bfloat16", "gpu") is None
    with pytest.raises(UserError, match=re.escape('train.dtype = "bfloat16" needs train.device = "gpu"')):
        precision.compute_dtype("bfloat16", np)


def test_mpi_sums_bfloat16_as_float32_and_puts_it_back():
    buf = np.array([1.0, 2.5], dtype=ml_dtypes.bfloat16)
    wide, put_back = comm._reducible(buf)
    assert wide.dtype == np.float32 and wide is not buf
    wide[...] = [3.0, 4.0]
    put_back()
    assert buf.dtype == ml_dtypes.bfloat16 and list(buf.astype(np.float32)) == [3.0, 4.0]
    same, _ = comm._reducible(np.zeros(2, np.float32))
    assert same.dtype == np.float32


def test_the_sizes_and_names_the_performance_model_and_the_collectives_ask_for_are_precision_s():
    """The performance model's bytes per element and master dtype, NCCL's type and the bits a type MPI
    has no name for moves as: each is asked of precision.py, and agrees with the dtypes the engine uses."""
    from types import SimpleNamespace

    from boostmpi.parallel import nccl
    from boostmpi.sim import costs, memory, model

    for name in precision.NAMES:
        compute = compute_on_this_machine(name)
        assert precision.itemsize(name) == costs.ITEMSIZE[name] == precision.itemsize(compute) == compute.itemsize
        master = np.dtype(precision.master_dtype(name))
        assert precision.master_dtype_name(name) == model.master_dtype(name) == master.name
        assert memory.master_itemsize(name) == master.itemsize
        assert precision.nccl_dtype_name(compute) == compute.name  # NCCL sums every compute dtype as itself
        assert np.dtype(precision.bits_dtype(compute)).itemsize == compute.itemsize
    assert precision.nccl_dtype_name(np.float16) is None
    library = SimpleNamespace(NCCL_FLOAT32=7, NCCL_BFLOAT16=9)
    assert nccl._dtype(library, np.dtype(np.float32)) == 7
    assert nccl._dtype(library, np.dtype(ml_dtypes.bfloat16)) == 9
    with pytest.raises(TypeError, match="NCCL cannot move arrays of dtype float64"):
        nccl._dtype(library, np.dtype(np.float64))  # a library without the type
    bits = comm._bits(np.array([1.5, -2.0], dtype=ml_dtypes.bfloat16))
    assert bits.dtype == np.uint16 and list(bits.view(ml_dtypes.bfloat16).astype(np.float32)) == [1.5, -2.0]
    assert comm.HostCollectives(None).sum([1, 2]).dtype == precision.HOST_DTYPE and precision.itemsize(precision.HOST_DTYPE) == 8
