"""The stand-in frontend's sdpa and sdpa_backward: what validate refuses, the workspace each asks for,
and execute on the CuPy stand-in's device memory (float32 compute with NumPy, see cudnn/__init__.py)."""

import numpy as np

import cudnn

_IO = (cudnn.data_type.HALF, cudnn.data_type.BFLOAT16)


def _refuse(message):
    raise cudnn.cudnnGraphNotSupportedError(f"[cudnn_frontend] Error: {message}")


def validate(graph):
    if graph.node is None:
        raise ValueError(f"graph {graph.name!r} has no operation")
    op, ports, params = graph.node
    q, k, v = ports["q"], ports["k"], ports["v"]
    for name, t in ports.items():
        if len(t.dim) != 4 or len(t.stride) != 4:
            _refuse(f"sdpa's {name} must be 4-D (b, h, s, d), got dim {t.dim} stride {t.stride}")
    B, H, T, D = q.dim
    Hkv = k.dim[1]
    if k.dim != [B, Hkv, T, D] or v.dim != k.dim:
        _refuse(f"k {k.dim} / v {v.dim} do not match q {q.dim} (b, h_k, s_kv, d)")
    if D % 8 or D > 128:
        _refuse(f"head dim {D}: the stand-in's 1.28 takes multiples of 8 up to 128")
    if Hkv == 0 or H % Hkv:
        _refuse(f"{H} query heads are not a multiple of {Hkv} key/value heads")
    for name, t in ports.items():
        expect = (cudnn.data_type.FLOAT,) if name == "stats" else _IO
        if t.data_type not in expect:
            _refuse(f"sdpa's {name} has data type {t.data_type.name}; {'float32' if name == 'stats' else 'fp16/bf16'} expected")
    for name, t in graph.outputs.items():
        if t.is_virtual:
            _refuse(f"{op}'s {name} is not marked as an output (set_output(True))")
        if name == "Stats" and (t.data_type != cudnn.data_type.FLOAT or t.dim != [B, H, T, 1]):
            _refuse(f"sdpa's Stats must be float32 [b, h, s, 1], got {t.data_type.name} {t.dim}")
        if name != "Stats" and t.data_type not in _IO:
            _refuse(f"{op}'s {name} has data type {t.data_type.name}; fp16/bf16 expected")
    scale = params.get("attn_scale")
    if scale is not None and not isinstance(scale, (int, float)):
        raise NotImplementedError("the stand-in models attn_scale as a Python number or None")


def workspace_bytes(graph):
    op, ports, _ = graph.node
    B, H, T, D = ports["q"].dim
    return 4 * B * H * T * (1 if op == "sdpa" else D + 1)


_NUMPY = {cudnn.data_type.FLOAT: np.dtype(np.float32), cudnn.data_type.HALF: np.dtype(np.float16)}


def _numpy_dtype(t):
    if t.data_type == cudnn.data_type.BFLOAT16:
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return _NUMPY[t.data_type]


def _pointer(data):
    if type(data) is int:
        return data
    ptr = getattr(getattr(data, "data", None), "ptr", None)
    if ptr is None:
        raise TypeError(f"execute: a buffer must be a device address or a CuPy array, got {type(data).__name__}")
    return int(ptr)


def _view(t, ptr):
    """A writable NumPy view of tensor `t` at device address `ptr`, through its declared dims and strides."""
    from cupy import _memory

    dtype = _numpy_dtype(t)
    if any(s < 0 for s in t.stride):
        raise ValueError(f"tensor {t.name!r}: negative stride {t.stride}")
    extent = (sum((n - 1) * s for n, s in zip(t.dim, t.stride)) + 1) * dtype.itemsize
    if ptr % dtype.itemsize:
        raise ValueError(f"tensor {t.name!r} at {ptr:#x} is not aligned to {dtype.itemsize} bytes")
    raw, _ = _memory.host_view(ptr, extent)
    view = np.lib.stride_tricks.as_strided(raw.view(dtype), shape=tuple(t.dim),
                                           strides=tuple(s * dtype.itemsize for s in t.stride))
    return view, extent


def _workspace_size(workspace):
    if workspace is None:
        return 0
    if type(workspace) is int:
        from cupy import _memory

        _, mem = _memory.host_view(workspace, 0)
        return mem.ptr + mem.size - workspace
    return int(workspace.nbytes)


def _operands(graph, tensor_dict):
    by_key = {}
    for key, data in tensor_dict.items():
        if isinstance(key, cudnn.Tensor):
            t = key
        elif isinstance(key, int):
            t = next((x for x in graph.tensors if x.uid == key), None)
        else:
            t = next((x for x in graph.tensors if x.name == key), None)
        if t is None or t.graph is not graph:
            raise ValueError(f"execute: {key!r} is not a tensor of graph {graph.name!r}")
        by_key[t.uid] = (t, _pointer(data))
    _, ports, _ = graph.node
    needed = list(ports.values()) + list(graph.outputs.values())
    for t in needed:
        if t.uid not in by_key:
            raise ValueError(f"the variant pack is missing a buffer for tensor uid {t.uid} ({t.name!r})")
    return ports, {name: by_key[t.uid] for name, t in list(ports.items()) + list(graph.outputs.items())}


def execute(graph, tensor_dict, workspace, handle):
    import cupy
    from cupy import _memory
    from cupy.cuda import _order, _queue
    from cupy.cuda import graph as cuda_graph

    if not isinstance(handle, cudnn.Handle):
        raise TypeError(f"execute needs a cudnn.Handle, got {type(handle).__name__}")
    current = cupy.cuda.get_current_stream().ptr
    if handle.stream != current:
        raise RuntimeError(f"execute of {graph.name!r} with the handle on stream {handle.stream:#x} while CuPy's current "
                           f"stream is {current:#x}: cuDNN would run it on the handle's stream, unordered with CuPy's work")
    need, have = workspace_bytes(graph), _workspace_size(workspace)
    if have < need:
        raise RuntimeError(f"execute of {graph.name!r}: workspace of {have} bytes, the plan needs {need} "
                           "(CUDNN_STATUS_BAD_PARAM)")
    ports, operands = _operands(graph, tensor_dict)
    views, record = {}, {}
    stream = next(s for s in _queue.Stream._live if s.ptr == handle.stream)
    capture = cuda_graph.device_work(stream)
    issued, where = _order.issue(stream), _order.call_site()
    for name, (t, ptr) in operands.items():
        views[name], nbytes = _view(t, ptr)
        record[name] = (tuple(t.dim), tuple(t.stride), nbytes)
        written = name in graph.outputs
        _order.access_pointer(ptr, nbytes, written, issued,
                              f"cuDNN {graph.node[0]} ({name} {'written' if written else 'read'})", where)
    op, _, params = graph.node
    cudnn.executions.append({"graph": graph.name, "op": op, "stream": current, "operands": record, "params": dict(params)})
    del cudnn.executions[:-cudnn.MAX_RECORDS]
    if capture is not None:  # recorded into the CUDA graph: run at each launch (cupy/cuda/graph.py)
        run = _forward if op == "sdpa" else _backward
        cuda_graph.record_quiet(capture, f"cuDNN {op} ({graph.name})", lambda: run(views, params),
                                [_memory.host_view(ptr, 1)[1] for _, ptr in operands.values()])
        return
    if _memory.META:
        return
    (_forward if op == "sdpa" else _backward)(views, params)


def _scores(q, k, params):
    """Scaled scores [B, H, T, T] (float32) with the declared mask, and the group size."""
    G = q.shape[1] // k.shape[1]
    kk = np.repeat(k, G, axis=1)  # the stand-in's arithmetic only: the device buffers keep Hkv heads
    scale = params.get("attn_scale")
    s = np.matmul(q, kk.swapaxes(-1, -2)) * np.float32(1.0 if scale is None else scale)
    causal = (params.get("use_causal_mask") or params.get("use_causal_mask_bottom_right")
              or params.get("diagonal_band_right_bound") == 0)
    if causal:
        T = s.shape[-1]
        s[..., np.triu(np.ones((T, T), dtype=bool), 1)] = -np.inf
    return s, G, np.float32(1.0 if scale is None else scale)


def _f32(view):
    return np.asarray(view, dtype=np.float32)


def _forward(views, params):
    q, k, v = _f32(views["q"]), _f32(views["k"]), _f32(views["v"])
    s, G, _ = _scores(q, k, params)
    m = s.max(axis=-1, keepdims=True)
    e = np.exp(s - m)
    total = e.sum(axis=-1, keepdims=True)
    views["O"][...] = np.matmul(e / total, np.repeat(v, G, axis=1)).astype(views["O"].dtype)
    if "Stats" in views:
        views["Stats"][...] = (m + np.log(total)).astype(np.float32)


def _group_sum(x, G):
    B, H, T, D = x.shape
    return x.reshape(B, H // G, G, T, D).sum(axis=2)


def _backward(views, params):
    q, k, v, o, do = (_f32(views[n]) for n in ("q", "k", "v", "o", "dO"))
    s, G, scale = _scores(q, k, params)
    p = np.exp(s - _f32(views["stats"]))
    dv = _group_sum(np.matmul(p.swapaxes(-1, -2), do), G)
    dp = np.matmul(do, np.repeat(v, G, axis=1).swapaxes(-1, -2))
    ds = p * (dp - (do * o).sum(axis=-1, keepdims=True))
    dq = np.matmul(ds, np.repeat(k, G, axis=1)) * scale
    dk = _group_sum(np.matmul(ds.swapaxes(-1, -2), q), G) * scale
    for name, value in (("dQ", dq), ("dK", dk), ("dV", dv)):
        views[name][...] = value.astype(views[name].dtype)
