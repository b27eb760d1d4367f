"""Which device memory each stand-in call reads and writes, for the order tracking (cuda/_order.py).

`instrument(namespace)` wraps the public functions of the stand-in's `cupy` namespace, the methods
of `ndarray`, `ufunc` and `RawKernel`, and `ndarray.__cuda_array_interface__`, by one rule:
- a call is one access on the current stream (a kernel launch: on its `stream=`); only the
  outermost stand-in call counts (what it calls internally is the same device work); a call that
  writes nothing and returns its array or a view of it (slicing, `reshape`, `transpose`, `asarray`
  of a device array, ...) launches nothing and is none;
- it reads every device array among its arguments (in lists and tuples too) and writes its `out=`,
  the array an in-place method changes (`a[k] = v` writes the bytes of `a[k]` only, `a += b`,
  `fill`, `set`) and every new array it returns (a returned view writes nothing);
- a RawKernel writes the arrays passed for non-`const` pointer parameters and reads the others;
- `get()` (and `item`, `tolist`, `float()`, `bool()`, `repr`..., which copy to the host as CuPy
  does) reads on its stream and then synchronizes that stream, as CuPy's `ndarray.get` does
  (cupy/_core/core.pyx at v14.2.0: `copy_to_host_async(..., stream)` then `stream.synchronize()`);
- `__cuda_array_interface__` is how mpi4py takes a device buffer (CUDA-aware MPI). mpi4py does not
  wait for any stream: it reads the interface's data, typestr, shape, strides, descr and mask, never
  its `stream` (src/mpi4py/MPI.src/ascaibuf.pxi), and its CuPy demo synchronizes the current stream
  before every MPI call (https://github.com/mpi4py/mpi4py/blob/master/demo/cuda-aware-mpi/use_cupy.py),
  so the access is
  the host's, ordered only after what the host has synchronized; whether MPI will read or write
  the buffer is not known here, so it counts as a write (ordered after every earlier access).
"""

import functools
import sys
import threading
import types

import numpy as np

from cupy.cuda import _order

try:
    from numpy.lib.array_utils import byte_bounds
except ImportError:  # NumPy < 2
    byte_bounds = np.byte_bounds

_state = threading.local()
_HOST_COPIES = {"get", "item", "tolist", "__float__", "__int__", "__index__", "__bool__", "__repr__", "__str__",
                "__format__"}
_IN_PLACE = {"fill", "set", "__setitem__"} | {
    f"__i{op}__" for op in ("add", "sub", "mul", "truediv", "pow", "and", "or", "xor", "floordiv", "matmul")}
_NO_ACCESS_METHODS = {"__init__", "__array__", "__array_function__", "__len__", "__iter__", "__pos__", "_wrap_result",
                      "_view", "_index", "__hash__"}
# module functions that allocate only, or hand over to a method that is tracked itself
_NO_ACCESS_FUNCTIONS = {"empty", "empty_like", "get_array_module", "isscalar", "result_type", "asnumpy", "transpose",
                        "reshape", "sum", "mean", "amax", "amin", "max", "min", "_module"}


def _arrays(obj, found):
    from cupy import ndarray

    if isinstance(obj, ndarray):
        found.append(obj)
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            _arrays(o, found)
    return found


def _span(arr, view=None):
    """Bytes [lo, hi) of arr's allocation that arr (or `view`, a NumPy view of its memory) covers."""
    a = arr._a if view is None else view
    lo, hi = byte_bounds(a)
    base = arr._mem.host.__array_interface__["data"][0]
    return lo - base, hi - base


def _describe(arr):
    return f"a {arr.dtype} array of shape {arr.shape}"


def _touch(arr, write, issued, what, where, view=None, doing=None):
    if arr._mem is None or not arr.size:
        return
    lo, hi = _span(arr, view)
    _order.access(arr._mem, lo, hi, write, issued, what, _describe(arr), where, doing)


def _outermost():
    return not getattr(_state, "depth", 0)


def _call(fn, args, kwargs):
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        return fn(*args, **kwargs)
    finally:
        _state.depth -= 1


def _device_work(what, fn, args, kwargs, reads, writes, stream=None, written_views=()):
    """Run fn as one access on `stream` (the current one if None): check and record reads and writes.
    A call that writes nothing and returns one of its arrays or a view of it (slicing, `reshape`,
    `asarray` of a device array, ...) or an empty array was no device work at all."""
    from cupy import ndarray
    from cupy.cuda import graph
    from cupy.cuda._queue import get_current_stream

    stream = get_current_stream() if stream is None else stream
    capture = graph.device_work(stream)
    if capture is None:
        result = _call(fn, args, kwargs)
        if not _order.ENABLED:
            return result
    else:  # recorded for the graph: shapes and allocations now, the values at each launch
        with graph.shapes_only():
            result = _call(fn, args, kwargs)
    if not writes and isinstance(result, ndarray) and (not result.size or any(result._mem is a._mem for a in reads)):
        return result
    issued = _order.issue(stream)
    where = _order.call_site()
    written = {id(a) for a in writes}
    for a in reads:
        if id(a) not in written:
            _touch(a, False, issued, what, where)
    for a in writes:
        _touch(a, True, issued, what, where, written_views[0] if written_views else None)
    inputs = {id(a._mem) for a in reads + writes if a._mem is not None}
    made = []
    for i, a in enumerate(_arrays(result, [])):
        if a._mem is not None and id(a._mem) not in inputs:  # a new array (a view of an input writes nothing)
            _touch(a, True, issued, what, where)
            made.append(i)
    if capture is not None:
        graph.record_call(capture, what, fn, args, kwargs, result, made)
    return result


def _function(name, fn):
    what = f"cupy.{name}"

    @functools.wraps(fn)
    def tracked(*args, **kwargs):
        if not _outermost():
            return fn(*args, **kwargs)
        out = kwargs.get("out")
        writes = _arrays(out, []) if out is not None else []
        if name == "copyto":
            writes = _arrays(args[:1], [])
        reads = _arrays(args, []) + _arrays([v for k, v in kwargs.items() if k != "out"], [])
        return _device_work(what, fn, args, kwargs, reads, writes)

    return tracked


def _method(name, fn):
    what = f"ndarray.{name}"

    @functools.wraps(fn)
    def tracked(self, *args, **kwargs):
        if not _outermost():
            return fn(self, *args, **kwargs)
        if name in _HOST_COPIES:
            from cupy.cuda._queue import get_current_stream

            from cupy.cuda import graph

            stream = kwargs.get("stream") or (args[0] if name == "get" and args else None) or get_current_stream()
            graph.host_transfer(stream, "D2H")  # memory.pyx:713 (copy_to_host_async, which get() calls)
            result = _device_work(what, fn, (self,) + args, kwargs, [self], [], stream)
            if kwargs.get("blocking", True):
                stream.synchronize()  # CuPy's copy to the host blocks until its stream is done
            return result
        if name == "set":
            from cupy.cuda import graph
            from cupy.cuda._queue import get_current_stream

            stream = kwargs.get("stream") or (args[1] if len(args) > 1 else None) or get_current_stream()
            graph.host_transfer(stream, "H2D")  # memory.pyx:614 (copy_from_host_async, which set() calls)
        reads = [self] + _arrays(args, []) + _arrays(list(kwargs.values()), [])
        writes, views = [], ()
        if name in _IN_PLACE:
            writes = [self]
            if name == "__setitem__":
                target = self._a[self._index(args[0])]
                if isinstance(target, np.ndarray) and np.may_share_memory(target, self._a) and target.size:
                    views = (target,)
                reads = reads[1:]  # a[k] = v reads v (and index arrays), not a
        return _device_work(what, fn, (self,) + args, kwargs, reads, writes, kwargs.get("stream"), views)

    return tracked


def _ufunc_call(fn):
    @functools.wraps(fn)
    def tracked(self, *args, out=None, **kwargs):
        if not _outermost():
            return fn(self, *args, out=out, **kwargs)
        if out is None and len(args) == self.nin + 1:
            args, out = args[:-1], args[-1]
        writes = _arrays(out, []) if out is not None else []
        return _device_work(f"cupy.{self.__name__}", fn, (self,) + args, dict(kwargs, out=out), _arrays(args, []),
                            writes)

    return tracked


def _ufunc_at(fn):
    @functools.wraps(fn)
    def tracked(self, a, indices, b=None):
        if not _outermost():
            return fn(self, a, indices, b)
        return _device_work(f"cupy.{self.__name__}.at", fn, (self, a, indices, b), {}, _arrays([indices, b], []), [a])

    return tracked


def _kernel_call(fn):
    @functools.wraps(fn)
    def tracked(self, grid, block, args, **kwargs):
        if not _outermost():
            return fn(self, grid, block, args, **kwargs)
        from cupy import ndarray

        params = getattr(self._function, "params", None) or []
        reads, writes = [], []
        for i, arg in enumerate(args if isinstance(args, tuple) else ()):
            if isinstance(arg, ndarray):
                const = i < len(params) and "const" in params[i].ctype.split("*")[0].split()
                (reads if const else writes).append(arg)
        stream = kwargs.get("stream")
        return _device_work(f"kernel {self.name}", fn, (self, grid, block, args), kwargs, reads, writes, stream)

    return tracked


def _array_interface(prop):
    def cai(self):
        if _outermost() and self._mem is not None and self.size:
            issued = _order.issue_host()
            try:
                _touch(self, True, issued, "CUDA-aware MPI (the buffer taken through __cuda_array_interface__)",
                       _order.call_site(), doing="reads or writes")
            except _order.StreamOrderError as exc:
                # mpi4py's Py_CheckCAIBuffer looks the attribute up inside `try: hasattr(...) except:
                # return 0`, so the error is lost and it reports only "expecting buffer": say it here too
                sys.stderr.write(f"StreamOrderError: {exc}\n")
                sys.stderr.flush()
                raise
        return prop.fget(self)

    return property(cai)


def instrument(ns):
    """Wrap the stand-in's namespace `ns` (the `cupy` module's globals) for the order tracking and for
    stream capture (cuda/graph.py), which needs the wrappers with the tracking off too."""
    ndarray, ufunc = ns["ndarray"], ns["ufunc"]
    for name, fn in list(ns.items()):
        if isinstance(fn, types.FunctionType) and not name.startswith("_") and name not in _NO_ACCESS_FUNCTIONS \
                and fn.__module__ == ns["__name__"]:
            ns[name] = _function(name, fn)
    for name, fn in list(vars(ndarray).items()):
        if isinstance(fn, types.FunctionType) and name not in _NO_ACCESS_METHODS:
            setattr(ndarray, name, _method(name, fn))
    ndarray.__cuda_array_interface__ = _array_interface(vars(ndarray)["__cuda_array_interface__"])
    ufunc.__call__ = _ufunc_call(ufunc.__call__)
    ufunc.at = _ufunc_at(ufunc.at)
    ufunc.reduce = _function("reduce", ufunc.reduce)
    kernel = ns["RawKernel"]
    kernel.__call__ = _kernel_call(kernel.__call__)
