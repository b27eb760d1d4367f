"""Stand-in for nvidia-cudnn-frontend 1.28.0's graph API: the calls boostmpi/gpu/attention_cudnn.py makes,
on the CuPy stand-in's device memory, computed with NumPy.

It is on sys.path only with the CuPy stand-in (tests/support/gpu_setup.py: no GPU reachable), where the real
frontend could reach no GPU either. What it models of 1.28:
- every keyword of every call is checked against the C++ binding's signature of 1.28, read from
  tests/cudnn_calls_checked.txt (1.28's Python layer itself accepts any keyword for sdpa: a misspelled
  `causal=True` would build there and mean nothing);
- `create_handle` fails, as cudnnCreate does, unless libcudnn.so.9 is loaded in the process (the
  frontend does not load it from every place a wheel puts it); `build_library` makes a library of
  that name for tests to put on $LD_LIBRARY_PATH;
- a graph runs only after validate, build_operation_graph, create_execution_plans, check_support and
  build_plans (execute builds a graph not built yet, as 1.28 does); `builds` counts plan builds;
- refusals (cudnnGraphNotSupportedError at validate): a head dim not a multiple of 8 or over 128, query
  heads not a multiple of the key/value heads, float32 input/output tensors, statistics not float32;
  at execute: a workspace smaller than get_workspace_size, a current CuPy stream other than the
  handle's, a buffer missing;
- execute reads q, k, v, o, dO and stats from device memory through each tensor's DECLARED dims and
  strides and writes O, Stats, dQ, dK, dV the same way (float32 compute, bfloat16 rounding on store),
  applying the declared attn_scale (None: no scaling) and causal mask; `executions` records each
  operand's declared dims, strides and bytes.
The workspace sizes are the stand-in's own (a float32 [B, H, T] row statistic for the forward, plus a
float32 dQ accumulator for the backward), there to make the workspace path run, not cuDNN's numbers.
"""

import collections
import enum
import hashlib
import os
import subprocess
import tempfile
from pathlib import Path


__version__ = "1.28.0"
STANDIN = True

_CHECKED = Path(__file__).resolve().parents[3] / "tests" / "cudnn_calls_checked.txt"


def _signatures():
    rows = {}
    for line in _CHECKED.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, words = line.partition("|")
            rows[name.strip()] = set(words.split())
    return rows


SIGNATURES = _signatures()
builds = collections.Counter()  # graph name -> plan builds
executions = []  # one dict per execute: graph, stream, operands {name: (dims, strides, nbytes)}, params
MAX_RECORDS = 256


class data_type(enum.IntEnum):  # values of 1.28's cudnn.data_type
    NOT_SET = 0
    FLOAT = 1
    DOUBLE = 2
    HALF = 3
    INT32 = 5
    UINT8 = 7
    BFLOAT16 = 10
    INT64 = 11


class heur_mode(enum.IntEnum):
    A = 0
    B = 1
    FALLBACK = 2


class build_plan_policy(enum.IntEnum):
    HEURISTICS_CHOICE = 0
    ALL = 1


class cudnnGraphNotSupportedError(Exception):
    pass


def _check_keywords(call, kwargs):
    allowed = SIGNATURES[call]
    for key in kwargs:
        if key not in allowed:
            raise TypeError(f"{call}(): {key!r} is not a keyword of nvidia-cudnn-frontend 1.28's {call} "
                            "(tests/cudnn_calls_checked.txt)")


# ------------------------------------------------------------------ the library and handles
LIBRARY = "libcudnn.so.9"


def build_library():
    """A directory holding an (empty) shared library named libcudnn.so.9, compiled once with the host's
    C compiler: what a test puts on $LD_LIBRARY_PATH for boostmpi to preload."""
    source = "/* stand-in libcudnn.so.9: boostmpi preloads it; the stand-in frontend checks it is loaded */\n" \
             "int boostmpi_standin_cudnn(void) { return 9; }\n"
    where = Path(tempfile.gettempdir()) / f"boostmpi-cudnn-standin-{hashlib.sha1(source.encode()).hexdigest()[:12]}"
    library = where / LIBRARY
    if not library.exists():
        where.mkdir(parents=True, exist_ok=True)
        (where / "standin.c").write_text(source)
        partial = where / f"{LIBRARY}.{os.getpid()}"
        subprocess.run([os.environ.get("CC", "cc"), "-shared", "-fPIC", "-o", str(partial), str(where / "standin.c")],
                       check=True, capture_output=True)
        os.replace(partial, library)
    return where


def _libcudnn_loaded():
    try:
        return any(line.rstrip().endswith("/" + LIBRARY) for line in open("/proc/self/maps"))
    except OSError:
        return False


class Handle:
    _next = 0x7000

    def __init__(self, device):
        Handle._next += 0x10
        self.backend_handle, self.device, self.stream = Handle._next, device, 0


def create_handle(**kwargs):
    _check_keywords("create_handle", kwargs)
    if not _libcudnn_loaded():
        raise RuntimeError("cudnnCreate failed: CUDNN_STATUS_NOT_INITIALIZED (no libcudnn.so.9 in this process)")
    import cupy

    return Handle(cupy.cuda.Device().id)


def set_stream(handle, stream):
    if not isinstance(handle, Handle):
        raise TypeError(f"cudnn.set_stream expects a cudnn.Handle (from cudnn.create_handle()), got {type(handle).__name__}")
    if type(stream) is not int:
        raise TypeError(f"_raw_set_stream(): incompatible function arguments (stream must be an int, got {type(stream).__name__})")
    handle.stream = stream


def get_stream(handle):
    return handle.stream


# ------------------------------------------------------------------ graphs
class Tensor:
    def __init__(self, graph, dim, stride, dtype, name, virtual=False):
        self.graph, self.dim, self.stride, self.data_type, self.name = graph, list(dim), list(stride), dtype, name
        self.is_virtual, self.uid = virtual, graph._new_uid()

    def _set(self, call, attr, value):
        self.graph._check_mutable()
        setattr(self, attr, value)
        return self

    def set_output(self, value):
        return self._set("set_output", "is_virtual", not value)

    def set_dim(self, dim):
        return self._set("set_dim", "dim", list(dim))

    def set_stride(self, stride):
        return self._set("set_stride", "stride", list(stride))

    def set_data_type(self, dtype):
        return self._set("set_data_type", "data_type", data_type(dtype))

    def get_dim(self):
        return list(self.dim)

    def get_stride(self):
        return list(self.stride)

    def get_data_type(self):
        return self.data_type

    def get_uid(self):
        return self.uid


def _row_major(dim):
    out, step = [], 1
    for n in reversed(dim):
        out.insert(0, step)
        step *= n
    return out


_UNMODELLED = {"bias", "block_mask", "use_alibi_mask", "use_padding_mask", "seq_len_q", "seq_len_kv", "sliding_window_length",
               "diagonal_band_left_bound", "dropout", "rng_dump", "paged_attention_k_table", "paged_attention_v_table",
               "score_mod", "score_mod_bprop", "score_max", "score_sum_exp", "sink_token", "dSink_token", "dBias",
               "cu_seq_len_q", "cu_seq_len_kv", "paged_attention_max_seq_len_kv", "max_total_seq_len_q", "max_total_seq_len_kv"}


class pygraph:
    def __init__(self, *args, **kwargs):
        names = ("name", "io_data_type", "intermediate_data_type", "compute_data_type", "handle")
        kwargs.update(zip(names, args))
        _check_keywords("pygraph", kwargs)
        self.name = kwargs.get("name", "test_graph")
        self.io_data_type = kwargs.get("io_data_type")
        self.handle = kwargs.get("handle")
        self.tensors, self.node, self._uid, self.stage = [], None, 0, "open"

    def _new_uid(self):
        self._uid += 1
        return self._uid

    def _check_mutable(self):
        if self.stage != "open":
            raise RuntimeError(f"graph {self.name!r} is frozen ({self.stage}): build a new graph to change it")

    def tensor(self, dim, stride=None, data_type=None, is_virtual=False, **kwargs):
        _check_keywords("tensor", dict(kwargs, dim=dim, stride=stride, data_type=data_type, is_virtual=is_virtual))
        self._check_mutable()
        t = Tensor(self, dim, stride or _row_major(dim), globals()["data_type"](data_type or self.io_data_type or 0),
                   kwargs.get("name", ""), is_virtual)
        self.tensors.append(t)
        return t

    def _node(self, op, ports, outputs, args, kwargs):
        if len(args) > len(ports):
            raise TypeError(f"{op}() takes at most {len(ports)} positional arguments")
        kwargs.update(zip(ports, args))
        _check_keywords(op, kwargs)
        self._check_mutable()
        if self.node is not None:
            raise NotImplementedError("the stand-in models graphs of one sdpa or sdpa_backward node")
        given = {k for k, v in kwargs.items() if v is not None and v is not False}
        if given & _UNMODELLED:
            raise NotImplementedError(f"the stand-in does not model {op}'s {sorted(given & _UNMODELLED)}")
        missing = [p for p in ports if not isinstance(kwargs.get(p), Tensor)]
        if missing:
            raise TypeError(f"{op}(): {missing} must be tensors of this graph")
        self.node = (op, {p: kwargs[p] for p in ports}, {k: v for k, v in kwargs.items() if k not in ports})
        outs = []
        for name, like in outputs:
            dim = list(kwargs[like].dim) if like != "stats" else list(kwargs["q"].dim[:-1]) + [1]
            t = Tensor(self, dim, _row_major(dim), self.io_data_type or data_type.NOT_SET, f"{op}::{name}", virtual=True)
            self.tensors.append(t)
            outs.append(t)
        self.outputs = dict(zip((n for n, _ in outputs), outs))
        return outs

    def sdpa(self, *args, **kwargs):
        params = dict(kwargs)
        if params.get("generate_stats") is None and params.get("is_inference") is None:
            raise ValueError("sdpa: one of generate_stats or is_inference must be set")
        outs = self._node("sdpa", ("q", "k", "v"), (("O", "q"), ("Stats", "stats")), args, kwargs)
        stats = params.get("generate_stats") if params.get("generate_stats") is not None else not params["is_inference"]
        if not stats:
            self.outputs.pop("Stats")
            outs[1] = None
        return outs

    def sdpa_backward(self, *args, **kwargs):
        return self._node("sdpa_backward", ("q", "k", "v", "o", "dO", "stats"), (("dQ", "q"), ("dK", "k"), ("dV", "v")),
                          args, kwargs)

    # ---- the build sequence
    def _advance(self, before, after):
        if self.stage != before:
            raise RuntimeError(f"graph {self.name!r}: {after} needs {before} first (it is at {self.stage})")
        self.stage = after

    def validate(self, **kwargs):
        _check_keywords("validate", kwargs)
        from cudnn import _attention

        _attention.validate(self)
        self._advance("open", "validate")

    def build_operation_graph(self, **kwargs):
        _check_keywords("build_operation_graph", kwargs)
        self._advance("validate", "build_operation_graph")

    def create_execution_plans(self, heuristics=None, **kwargs):
        _check_keywords("create_execution_plans", dict(kwargs, heuristics=heuristics))
        if not heuristics or any(not isinstance(h, heur_mode) for h in heuristics):
            raise TypeError(f"create_execution_plans takes a list of cudnn.heur_mode, got {heuristics!r}")
        self._advance("build_operation_graph", "create_execution_plans")

    def check_support(self, **kwargs):
        _check_keywords("check_support", kwargs)
        self._advance("create_execution_plans", "check_support")

    def build_plans(self, policy=build_plan_policy.HEURISTICS_CHOICE, **kwargs):
        _check_keywords("build_plans", dict(kwargs, policy=policy))
        self._advance("check_support", "built")
        builds[self.name] += 1

    def get_workspace_size(self, **kwargs):
        _check_keywords("get_workspace_size", kwargs)
        if self.stage != "built":
            raise RuntimeError(f"graph {self.name!r}: get_workspace_size before build_plans")
        from cudnn import _attention

        return _attention.workspace_bytes(self)

    def execute(self, tensor_dict, workspace=None, handle=None, **kwargs):
        _check_keywords("execute", dict(kwargs, tensor_dict=tensor_dict, workspace=workspace, handle=handle))
        if self.stage == "open":  # 1.28 plans and builds a graph executed before it was built
            self.validate()
        if self.stage != "built":
            for step in ("build_operation_graph", "create_execution_plans", "check_support", "build_plans"):
                if self.stage == {"build_operation_graph": "validate", "create_execution_plans": "build_operation_graph",
                                  "check_support": "create_execution_plans", "build_plans": "check_support"}[step]:
                    getattr(self, step)(*(([heur_mode.A],) if step == "create_execution_plans" else ()))
        from cudnn import _attention

        _attention.execute(self, tensor_dict, workspace, handle if handle is not None else self.handle)


def reset():
    """Forget the counts and records (a test's start)."""
    builds.clear()
    executions.clear()
