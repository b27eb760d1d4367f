"""A CuPy stand-in for tests on machines where CuPy cannot reach a GPU (see README.md here).

Arrays live in device allocations of the CUDA execution harness; arithmetic is carried out by
NumPy on views of that memory, with CuPy's type rules (ufunc loop tables, weak Python scalars,
float32 accumulation for 16-bit floats), CuPy's refusals (implicit conversion to NumPy, NumPy
operands) and RawKernel launches that run the kernel source itself through the harness.
"""

import builtins
import os

import numpy as np

from cupy import _memory, _record
from cupy._memory import get_default_memory_pool, get_default_pinned_memory_pool  # noqa: F401
from cupy import cuda  # noqa: F401

# the CuPy release whose source the stand-in follows; BOOSTMPI_STANDIN_CUPY_VERSION makes it report
# another (to test what start-up says about an older CuPy)
__version__ = os.environ.get("BOOSTMPI_STANDIN_CUPY_VERSION", "14.2.0") + "+standin"
__standin__ = True  # what tests and bench/ check to tell the stand-in from a GPU

try:
    import ml_dtypes

    _ML_BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # CuPy too has bfloat16 only with ml_dtypes
    _ML_BF16 = None
# CuPy 14.2 turns bfloat16 off entirely under NumPy < 2.1.2 (cupy/_util.pyx at v14.2.0 line 228:
# no bfloat16 ufunc loops; cupy/_core/_scalar.pyx line 277: no C type name, so creating a bfloat16
# array raises `ValueError: Unsupported dtype bfloat16` from _dtype.pyx check_supported_dtype)
BF16_ENABLED = _ML_BF16 is not None and np.lib.NumpyVersion(np.__version__) >= "2.1.2"
_bf16 = _ML_BF16 if BF16_ENABLED else None  # the loop tables' bfloat16 (CuPy exports no such name)

dtype = np.dtype
promote_types = np.promote_types
can_cast = np.can_cast
finfo, iinfo = np.finfo, np.iinfo
bool_, int8, int16, int32, int64 = np.bool_, np.int8, np.int16, np.int32, np.int64
uint8, uint16, uint32, uint64 = np.uint8, np.uint16, np.uint32, np.uint64
float16, float32, float64, complex64, complex128 = np.float16, np.float32, np.float64, np.complex64, np.complex128
inf, nan, pi, e, newaxis = np.inf, np.nan, np.pi, np.e, None

_IMPLICIT = ("Implicit conversion to a NumPy array is not allowed. "
             "Please use `.get()` to construct a NumPy array explicitly.")


def _is_half(dt):
    return dt == np.float16 or (_bf16 is not None and dt == _bf16)


# ================================================================== type resolution (CuPy's rules)
def _check_supported(dt):
    """_dtype.pyx check_supported_dtype (v14.2.0): a dtype CuPy has no C type name for is refused."""
    if issubclass(dt.type, np.void) or (BF16_ENABLED and dt == _ML_BF16):
        return  # raw bytes and structured dtypes are allowed; of ml_dtypes' types CuPy knows bfloat16 only
    raise ValueError(f"Unsupported dtype {dt}")


def _loop_table(chars, bf16_after="e"):
    """Loop dtypes in CuPy's order; bfloat16's loop directly after float16's (CuPy pull request 9494, its bfloat16 support)."""
    out = []
    for c in chars:
        out.append(np.dtype(c))
        if c == bf16_after and _bf16 is not None:
            out.append(_bf16)
    return out


_ARITHMETIC = _loop_table("?bBhHiIlLqQefdFD")
_INEXACT = _loop_table("efdFD")
_TRUE_DIVIDE = [np.dtype("q")] + _loop_table("efdFD")  # CuPy's 'qq->d' family first
_ROUNDING = _loop_table("efd")
_BITWISE = [np.dtype(c) for c in "?bBhHiIlLqQ"]
_SCALAR_KIND = {bool: 0, int: 1, float: 2, complex: 2}


def _kind_score(dt):
    if dt == np.bool_:
        return 0
    if dt.kind in "iu":
        return 1
    return 2 if dt.kind in "fc" or dt == _bf16 else 3


class _Operand:
    """One ufunc input: a device array, or a scalar (weak when it is a Python number)."""

    __slots__ = ("value", "dtype", "weak")

    def __init__(self, x):
        if isinstance(x, ndarray):
            self.value, self.dtype, self.weak = x._a, x.dtype, None
        elif isinstance(x, np.ndarray):
            raise TypeError(f"Unsupported type {type(x)}")
        elif isinstance(x, np.generic):  # before Python numbers: np.float64 is a float subclass, but strong
            self.value, self.dtype, self.weak = x, x.dtype, None
        elif isinstance(x, (bool, int, float, complex)):
            self.value, self.dtype, self.weak = x, np.dtype(type(x)), type(x)
        else:
            raise TypeError(f"Unsupported type {type(x)}")


def _use_weak_scalars(operands):
    """CuPy's _check_should_use_weak_scalar: weak only against arrays of at least the scalar's kind."""
    arrays = [_kind_score(o.dtype) for o in operands if o.weak is None]
    scalars = [_SCALAR_KIND[o.weak] for o in operands if o.weak is not None]
    return bool(arrays) and bool(scalars) and builtins.max(arrays) >= builtins.max(scalars)


def _select_loop(name, loops, operands):
    """The first loop every input casts to safely (a weak scalar: if it does not promote the loop)."""
    weak = _use_weak_scalars(operands)
    for loop in loops:
        for o in operands:
            if np.can_cast(o.dtype, loop):
                continue
            if not (weak and o.weak is not None):
                break
            try:
                if np.result_type(o.weak(0), loop) != loop:
                    break
            except TypeError:
                break
        else:
            return loop
    raise TypeError(f"Wrong type ({tuple(o.dtype for o in operands)}) of arguments for cupy_{name}")


def result_type(*arrays_and_dtypes):
    dts = [a.dtype if isinstance(a, ndarray) else a for a in arrays_and_dtypes]
    return np.result_type(*dts)


# ================================================================== the array
def _check_same_kind(src, dst, what):
    if src == dst or src.kind == dst.kind or np.can_cast(src, dst, "same_kind"):
        return
    raise TypeError(f"Cannot cast {what} from {src!r} to {dst!r} according to the rule 'same_kind'")


def _compute(loop, values):
    """Inputs as NumPy values in the loop's dtype; 16-bit floats are computed in float32 (as
    CuPy's half and bfloat16 loops do) and rounded once by the caller."""
    work = np.dtype(np.float32) if _is_half(loop) else np.dtype(loop)
    return [v.astype(work, copy=False) if isinstance(v, np.ndarray) else work.type(v) for v in values]


class ndarray:
    """A device array. Not convertible to NumPy implicitly; `.get()` copies it to the host."""

    __array_priority__ = 100
    __array_ufunc__ = None  # NumPy operators give way to ours, which refuse NumPy operands

    def __init__(self, shape, dtype=float, memptr=None, strides=None, order="C"):
        if memptr is not None or strides is not None:
            raise NotImplementedError("the stand-in makes arrays from memptr only through cupy functions")
        shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
        dt = np.dtype(dtype)
        if dt.kind == "V":
            _check_supported(dt)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        self._mem = _memory.alloc(nbytes) if nbytes else None  # core.pyx: memory.alloc, the current allocator
        self._a = _memory.empty_bytes_view(self._mem, nbytes, dt, shape) if nbytes else np.empty(shape, dt)
        self.base = None

    @classmethod
    def _view(cls, a, mem, base):
        out = cls.__new__(cls)
        out._a, out._mem, out.base = a, mem, base
        return out

    def _wrap_result(self, r):
        """A NumPy result of an operation on self._a: a view of our memory, or a new device array."""
        if not isinstance(r, np.ndarray):
            r = np.asarray(r)
        if self._mem is not None and r.size and np.may_share_memory(r, self._a):
            return ndarray._view(r, self._mem, self if self.base is None else self.base)
        return _device_copy(r)

    # -- attributes
    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    ndim = property(lambda self: self._a.ndim)
    size = property(lambda self: self._a.size)
    itemsize = property(lambda self: self._a.itemsize)
    nbytes = property(lambda self: self._a.nbytes)
    strides = property(lambda self: self._a.strides)
    flags = property(lambda self: self._a.flags)
    T = property(lambda self: self.transpose())

    @property
    def data(self):
        if self._mem is None:
            return _memory.MemoryPointer(None, 0)
        return _memory.MemoryPointer(self._mem, _memory.device_address(self._mem, self._a))

    @property
    def device(self):
        return cuda.Device()

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.shape, "typestr": self.dtype.str, "descr": self.dtype.descr,
                "data": (self.data.ptr, False), "version": 3,
                "strides": None if self.flags.c_contiguous else self.strides, "stream": 1}

    # -- conversions: explicit only
    def __array__(self, *args, **kwargs):
        raise TypeError(_IMPLICIT)

    def __array_function__(self, func, types, args, kwargs):
        impl = globals().get(func.__name__)
        if impl is None or not callable(impl):
            return NotImplemented
        return impl(*args, **kwargs)

    def get(self, stream=None, order="C", out=None, blocking=True):
        host = _host_value(self.shape, self.dtype) if _memory.META else np.array(self._a, copy=True, order=order)
        if out is not None:
            out[...] = host
            return out
        return host

    def set(self, arr, stream=None):
        if not isinstance(arr, np.ndarray):
            raise TypeError("Only numpy.ndarray can be set to cupy.ndarray")
        if arr.dtype != self.dtype:
            raise TypeError(f"{arr.dtype} array cannot be set to {self.dtype} array")
        if arr.shape != self.shape:
            raise ValueError(f"Shape mismatch. Old shape: {self.shape}, new shape: {arr.shape}")
        if not _memory.META:
            self._a[...] = arr

    def item(self):
        if self.size != 1:
            raise ValueError("can only convert an array of size 1 to a Python scalar")
        if _memory.META:
            return _host_value((), self.dtype).item()
        return self._a.reshape(-1)[0].item()

    def tolist(self):
        return self.get().tolist() if _memory.META else self._a.tolist()

    def __float__(self):
        return float(self.item())

    def __int__(self):
        return int(self.item())

    def __index__(self):
        if self.dtype.kind not in "iu" or self.ndim:
            raise TypeError("only integer scalar arrays can be converted to a scalar index")
        return int(self.item())

    def __bool__(self):
        return bool(self.item())

    def __len__(self):
        if not self.ndim:
            raise TypeError("len() of unsized object")
        return self.shape[0]

    def __iter__(self):
        if not self.ndim:
            raise TypeError("iteration over a 0-d array")
        return (self[i] for i in range(self.shape[0]))

    def __repr__(self):
        return repr(self._a)

    def __str__(self):
        return str(self._a)

    def __format__(self, spec):
        return format(self.item(), spec) if self.size == 1 else str(self)

    # -- shape and views
    def reshape(self, *shape, order="C"):
        shape = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
        if _memory.META:
            try:  # a view when the strides allow one, else a copy (no values to move)
                return self._wrap_result(np.reshape(self._a, shape, order=order, copy=False))
            except ValueError:
                np.reshape(np.empty(self.shape, np.dtype([])), shape)  # NumPy's errors for a bad shape
                return _new(np.empty(self.shape, np.dtype([])).reshape(shape).shape, self.dtype)
        return self._wrap_result(self._a.reshape(shape, order=order))

    def transpose(self, *axes):
        axes = axes[0] if len(axes) == 1 and isinstance(axes[0], (tuple, list)) else axes
        return self._wrap_result(self._a.transpose(*axes) if axes else self._a.T)

    def swapaxes(self, a, b):
        return self._wrap_result(self._a.swapaxes(a, b))

    def ravel(self, order="C"):
        if _memory.META:
            return self.reshape(-1, order=order)
        return self._wrap_result(self._a.ravel(order))

    def flatten(self):
        if _memory.META:
            return _new((self.size,), self.dtype)
        return _device_copy(self._a.flatten())

    def squeeze(self, axis=None):
        return self._wrap_result(self._a.squeeze(axis))

    def view(self, dtype=None):
        return self._wrap_result(self._a if dtype is None else self._a.view(dtype))

    def copy(self, order="C"):
        if _memory.META:
            return _new(self.shape, self.dtype)
        return _device_copy(self._a, order)

    def astype(self, dtype, order="K", casting=None, subok=None, copy=True):
        dt = np.dtype(dtype)
        if _record.active is not None:
            _record.note("astype", _record.arg(self), dt.name)
        if not copy and dt == self.dtype:
            return self
        if _memory.META:
            return _new(self.shape, dt)
        return _device_copy(self._a.astype(dt))

    def fill(self, value):
        if isinstance(value, np.ndarray) and value.ndim:
            raise TypeError(f"Unsupported type {type(value)}")
        if not _memory.META:
            self._a.fill(value._a.item() if isinstance(value, ndarray) else value)

    # -- indexing
    @staticmethod
    def _index(key):
        key = key if isinstance(key, tuple) else (key,)
        out = []
        for k in key:
            if isinstance(k, ndarray):
                k = k._a
            out.append(k)
        if not any(k is Ellipsis for k in out):
            out.append(Ellipsis)  # integer indexing gives a 0-d array view, as CuPy's does
        return tuple(out)

    def __getitem__(self, key):
        _mask_sync(key)
        if _memory.META:
            return self._meta_getitem(self._index(key))
        return self._wrap_result(self._a[self._index(key)])

    def _meta_getitem(self, index):
        """Basic indexing is a view; a gather gets a new array of the shape NumPy gives (index arrays
        read as zeros, which are valid indices; a boolean mask's result depends on values)."""
        if not any(isinstance(k, (np.ndarray, list)) for k in index):
            return self._wrap_result(self._a[index])
        return _new(_meta_index_shape(self.shape, index), self.dtype)

    def __setitem__(self, key, value):
        if _record.active is not None:  # a copy into self: CuPy's elementwise_copy casts value to self's dtype
            _record.note("setitem", _record.arg(self), _record.arg(value))
        if isinstance(value, np.ndarray) and value.ndim:
            raise TypeError(f"Unsupported type {type(value)}")  # CuPy fills with scalars only
        _mask_sync(key)
        if isinstance(value, ndarray):
            value = value._a
        if _memory.META:  # the shapes must fit, as for a write
            index = self._index(key)
            target = _meta_index_shape(self.shape, index)
            np.broadcast_to(np.empty(np.shape(value), np.dtype([])), target)
            return
        self._a[self._index(key)] = value

    # -- reductions
    def sum(self, axis=None, dtype=None, out=None, keepdims=False):
        return _reduce("sum", self, axis, dtype, out, keepdims)

    def prod(self, axis=None, dtype=None, out=None, keepdims=False):
        return _reduce("prod", self, axis, dtype, out, keepdims)

    def mean(self, axis=None, dtype=None, out=None, keepdims=False):
        return _reduce("mean", self, axis, dtype, out, keepdims)

    def max(self, axis=None, out=None, keepdims=False):
        return _reduce("max", self, axis, None, out, keepdims)

    def min(self, axis=None, out=None, keepdims=False):
        return _reduce("min", self, axis, None, out, keepdims)

    def argmax(self, axis=None):
        if _memory.META:
            return _new(_reduced_shape(self.shape, axis, False), np.dtype(np.int64))
        return _device_copy(np.asarray(self._a.argmax(axis)))

    def cumsum(self, axis=None, dtype=None):
        if _memory.META:
            dt = np.cumsum(np.zeros(1, self.dtype), dtype=dtype).dtype
            return _new((self.size,) if axis is None else self.shape, dt)
        return _device_copy(self._a.cumsum(axis, dtype))

    def all(self, axis=None, keepdims=False):
        if _memory.META:
            return _new(_reduced_shape(self.shape, axis, keepdims), np.dtype(bool))
        return _device_copy(np.asarray(self._a.all(axis, keepdims=keepdims)))

    def any(self, axis=None, keepdims=False):
        if _memory.META:
            return _new(_reduced_shape(self.shape, axis, keepdims), np.dtype(bool))
        return _device_copy(np.asarray(self._a.any(axis, keepdims=keepdims)))

    def dot(self, other):
        return dot(self, other)

    # -- operators
    def __neg__(self):
        return negative(self)

    def __pos__(self):
        return self

    def __abs__(self):
        return absolute(self)

    def __matmul__(self, other):
        return matmul(self, other)

    def __rmatmul__(self, other):
        return matmul(other, self)

    def __imatmul__(self, other):
        return matmul(self, other, out=self)


def _binary_operators():
    ops = {"add": add, "sub": subtract, "mul": multiply, "truediv": true_divide, "pow": power,
           "and": bitwise_and, "or": bitwise_or, "xor": bitwise_xor, "floordiv": floor_divide}
    for short, uf in ops.items():
        setattr(ndarray, f"__{short}__", lambda self, other, uf=uf: uf(self, other))
        setattr(ndarray, f"__r{short}__", lambda self, other, uf=uf: uf(other, self))
        setattr(ndarray, f"__i{short}__", lambda self, other, uf=uf: uf(self, other, out=self))
    for short, uf in {"lt": less, "le": less_equal, "gt": greater, "ge": greater_equal,
                      "eq": equal, "ne": not_equal}.items():
        setattr(ndarray, f"__{short}__", lambda self, other, uf=uf: uf(self, other))
    ndarray.__invert__ = lambda self: invert(self)
    ndarray.__hash__ = None


def _mask_sync(key):
    """A boolean mask's result size is read on the host (`n_true = int(mask_scanned[-1])`,
    cupy/_core/_routines_indexing.pyx:802 at v14.2.0): a copy to the host, refused during a capture."""
    if any(isinstance(k, ndarray) and k.dtype == np.bool_ for k in (key if isinstance(key, tuple) else (key,))):
        cuda.graph.host_transfer(cuda.get_current_stream(), "D2H")


def _device_copy(host, order="C"):
    """A new device array holding a copy of the NumPy array `host` (meta mode: its shape and dtype)."""
    host = np.asarray(host)
    out = ndarray(host.shape, host.dtype)
    if not _memory.META:
        out._a[...] = host
    return out


# ================================================================== shapes-only ("meta") mode (_memory.py)
def _new(shape, dtype):
    """A new device array with no values (meta mode)."""
    return ndarray(tuple(int(n) for n in shape), dtype)


def _host_value(shape, dtype):
    """What a host read returns in meta mode: every element META_HOST_VALUE."""
    return np.full(shape, _memory.META_HOST_VALUE).astype(dtype)


def _meta_index_shape(shape, index):
    """The shape NumPy's indexing gives, found on a zero-byte array of `shape` (no values moved).
    Index arrays count as zeros (valid indices, whatever the memory holds); a boolean mask, whose
    result depends on its values, counts as selecting every element (the largest result it can give)."""
    index = tuple((np.ones(k.shape, bool) if k.dtype == np.bool_ else np.zeros(k.shape, np.intp))
                  if isinstance(k, np.ndarray) else k for k in index)
    return np.empty(shape, np.dtype([]))[index].shape


def _reduced_shape(shape, axis, keepdims):
    if axis is None:
        axes = set(range(len(shape)))
    else:
        axes = {int(a) % len(shape) if len(shape) else 0 for a in (axis if isinstance(axis, tuple) else (axis,))}
    if keepdims:
        return tuple(1 if i in axes else n for i, n in enumerate(shape))
    return tuple(n for i, n in enumerate(shape) if i not in axes)


def _meta_result(shape, dtype, out, what):
    """A meta-mode result of `shape`: a new array, or `out` when its shape takes the result."""
    if out is None:
        return _new(shape, dtype)
    if not isinstance(out, ndarray):
        raise TypeError(f"Output arrays must be cupy.ndarray, got {type(out)}")
    if np.broadcast_shapes(tuple(shape), out.shape) != out.shape:
        raise ValueError(f"{what}: a result of shape {tuple(shape)} does not fit out of shape {out.shape}")
    return out


# ================================================================== ufuncs
def _broadcasts(arrays):
    shapes = {a.shape for a in arrays if isinstance(a, ndarray)}
    return len(shapes) > 1


def _note_call(name, args, out=None, dtype=None):
    parts = [_record.arg(a) for a in args]
    if out is not None:
        parts.append(f"out={_record.arg(out)}")
    if dtype is not None:
        parts.append(f"dtype={np.dtype(dtype).name}")
    if _broadcasts(list(args) + ([out] if out is not None else [])):
        parts.append("bcast")
    _record.note(name, *parts)


# ufunc.at: the value is cast to the target's dtype, and the scatter kernel takes only these types
# (cupy/_core/_routines_indexing.pyx at v14.2.0, _scatter_op_single, lines 940-1000)
_SCATTER_TYPES = {
    "add": ((np.int32, np.int64, np.float16, np.float32, np.float64, np.uint32, np.uint64),
            "int32, int64, float16, float32, float64, uint32, uint64"),
    "subtract": ((np.int32, np.uint32), "int32, uint32,"),
    "maximum": ((np.int32, np.int64, np.float32, np.float64, np.uint32, np.uint64),
                "int32, int64, float32, float64, uint32, uint64"),
    "minimum": ((np.int32, np.int64, np.float32, np.float64, np.uint32, np.uint64),
                "int32, int64, float32, float64, uint32, uint64"),
}


class ufunc:
    def __init__(self, name, np_func, loops, nin, out_dtype=None):
        self.__name__ = name
        self.name = f"cupy_{name}"
        self._np, self._loops, self.nin = np_func, loops, nin
        self._out_dtype = np.dtype(out_dtype) if out_dtype is not None and not callable(out_dtype) else out_dtype

    def __repr__(self):
        return f"<ufunc '{self.__name__}' (stand-in)>"

    def __call__(self, *args, out=None, dtype=None, casting="same_kind"):
        if len(args) == self.nin + 1 and out is None:
            args, out = args[:-1], args[-1]
        if len(args) != self.nin:
            raise TypeError(f"{self.__name__} takes {self.nin} inputs, got {len(args)}")
        if _record.active is not None:
            _note_call(self.__name__, args, out, dtype)
        operands = [_Operand(a) for a in args]
        if not any(isinstance(a, ndarray) for a in args) and out is None:
            raise TypeError(f"{self.__name__}: the stand-in needs at least one device array")
        loop = np.dtype(dtype) if dtype is not None else _select_loop(self.__name__, self._loops, operands)
        res_dtype = self._out_dtype(loop) if callable(self._out_dtype) else self._out_dtype or loop
        if _memory.META:
            if out is not None:
                _check_same_kind(np.dtype(res_dtype), out.dtype, "ufunc output")
            shape = np.broadcast_shapes(*(a.shape for a in args if isinstance(a, ndarray)))
            return _meta_result(shape, res_dtype, out, self.__name__)
        result = self._np(*_compute(loop, [o.value for o in operands]))
        result = np.asarray(result).astype(res_dtype, copy=False)
        if out is None:
            return _device_copy(result)
        if not isinstance(out, ndarray):
            raise TypeError(f"Output arrays must be cupy.ndarray, got {type(out)}")
        _check_same_kind(np.dtype(res_dtype), out.dtype, "ufunc output")
        out._a[...] = np.broadcast_to(result, out.shape).astype(out.dtype, copy=False)
        return out

    def at(self, a, indices, b=None):
        if _record.active is not None:
            _note_call(f"{self.__name__}.at", (a, indices, b))
        if self.__name__ not in _SCATTER_TYPES:
            raise NotImplementedError(f"`{self.name}.at` is not supported yet")
        idx = indices._a if isinstance(indices, ndarray) else indices
        if isinstance(b, np.ndarray):
            raise TypeError(f"Unsupported type {type(b)}")
        if isinstance(idx, np.ndarray) and idx.dtype == np.bool_:
            raise NotImplementedError("the stand-in models `.at` with integer indices only (CuPy's mask path differs)")
        types, names = _SCATTER_TYPES[self.__name__]
        if not issubclass(a.dtype.type, types):  # the value is cast to a.dtype first
            raise TypeError(f"cupy.{self.__name__}.at only supports {names} as data type")
        if _memory.META:
            return
        value = b._a.astype(a.dtype) if isinstance(b, ndarray) else np.asarray(b, dtype=a.dtype)
        getattr(np, self.__name__).at(a._a, idx, value)

    def reduce(self, array, axis=0, dtype=None, out=None, keepdims=False):
        """Only add and multiply reduce (cupy/_core/_kernel.pyx at v14.2.0, ufunc.reduce, line 1459)."""
        if self.__name__ == "add":
            return array.sum(axis, dtype, out, keepdims)
        if self.__name__ == "multiply":
            return array.prod(axis, dtype, out, keepdims)
        raise NotImplementedError(f"`{self.name}.reduce` is not supported yet")


def _reciprocal(x):
    return np.reciprocal(x)


add = ufunc("add", np.add, _ARITHMETIC, 2)
subtract = ufunc("subtract", np.subtract, _ARITHMETIC[1:], 2)
multiply = ufunc("multiply", np.multiply, _ARITHMETIC, 2)
true_divide = divide = ufunc("true_divide", np.true_divide, _TRUE_DIVIDE, 2,
                             out_dtype=lambda loop: np.dtype(np.float64) if loop.kind in "iu" else loop)
floor_divide = ufunc("floor_divide", np.floor_divide, _ARITHMETIC[1:], 2)
power = ufunc("power", np.power, _ARITHMETIC, 2)
maximum = ufunc("maximum", np.maximum, _ARITHMETIC, 2)
minimum = ufunc("minimum", np.minimum, _ARITHMETIC, 2)
negative = ufunc("negative", np.negative, _ARITHMETIC[1:], 1)
absolute = abs = ufunc("absolute", np.absolute, _ARITHMETIC, 1)
reciprocal = ufunc("reciprocal", _reciprocal, _ARITHMETIC[1:], 1)
exp = ufunc("exp", np.exp, _INEXACT, 1)
log = ufunc("log", np.log, _INEXACT, 1)
sqrt = ufunc("sqrt", np.sqrt, _INEXACT, 1)
tanh = ufunc("tanh", np.tanh, _INEXACT, 1)
square = ufunc("square", np.square, _ARITHMETIC, 1)
floor = ufunc("floor", np.floor, _ROUNDING, 1)
isfinite = ufunc("isfinite", np.isfinite, _ARITHMETIC, 1, out_dtype=np.dtype(bool))
isnan = ufunc("isnan", np.isnan, _ARITHMETIC, 1, out_dtype=np.dtype(bool))
less = ufunc("less", np.less, _ARITHMETIC, 2, out_dtype=np.dtype(bool))
less_equal = ufunc("less_equal", np.less_equal, _ARITHMETIC, 2, out_dtype=np.dtype(bool))
greater = ufunc("greater", np.greater, _ARITHMETIC, 2, out_dtype=np.dtype(bool))
greater_equal = ufunc("greater_equal", np.greater_equal, _ARITHMETIC, 2, out_dtype=np.dtype(bool))
equal = ufunc("equal", np.equal, _ARITHMETIC, 2, out_dtype=np.dtype(bool))
not_equal = ufunc("not_equal", np.not_equal, _ARITHMETIC, 2, out_dtype=np.dtype(bool))
bitwise_and = logical_and = ufunc("bitwise_and", np.bitwise_and, _BITWISE, 2)
bitwise_or = ufunc("bitwise_or", np.bitwise_or, _BITWISE, 2)
bitwise_xor = ufunc("bitwise_xor", np.bitwise_xor, _BITWISE, 2)
invert = ufunc("invert", np.invert, _BITWISE, 1)
_binary_operators()


# ================================================================== reductions
def _reduce(kind, a, axis, dtype, out, keepdims):
    """CuPy's reductions: integers sum in int64 and average in float64; float16 and bfloat16
    accumulate in float32 and round once; with `dtype`, the work happens in that dtype."""
    src = a.dtype
    if _record.active is not None:
        _record.note(kind, _record.arg(a), "all" if axis is None else "axis", *([f"dtype={np.dtype(dtype).name}"] if dtype is not None else []),
                     *(["out"] if out is not None else []))
    if _memory.META:
        if kind in ("max", "min"):
            res_dtype = src
        elif dtype is not None:
            res_dtype = np.dtype(dtype)
        elif src.kind in "biu" or src == np.bool_:
            res_dtype = np.dtype(np.float64) if kind == "mean" else np.dtype(np.int64 if src.kind != "u" else np.uint64)
        else:
            res_dtype = src
        return _meta_result(_reduced_shape(a.shape, axis, keepdims), res_dtype, out, kind)
    if kind in ("max", "min"):
        if a.size == 0 and axis is None:
            raise ValueError("zero-size array to reduction operation which has no identity")
        result = getattr(np, kind)(a._a.astype(np.float32) if _is_half(src) else a._a, axis=axis, keepdims=keepdims)
        res_dtype = src
    else:
        if dtype is not None:
            res_dtype = work = np.dtype(dtype)
        elif src.kind in "biu" or src == np.bool_:
            res_dtype = work = np.dtype(np.float64) if kind == "mean" else np.dtype(np.int64 if src.kind != "u" else np.uint64)
        else:
            res_dtype, work = src, src
        if _is_half(work):
            work = np.dtype(np.float32)
        result = getattr(np, kind)(a._a.astype(work, copy=False), axis=axis, keepdims=keepdims)
    result = np.asarray(result).astype(res_dtype, copy=False)
    if out is None:
        return _device_copy(result)
    out._a[...] = result
    return out


def sum(a, axis=None, dtype=None, out=None, keepdims=False):  # noqa: A001
    return a.sum(axis, dtype, out, keepdims)


def mean(a, axis=None, dtype=None, out=None, keepdims=False):
    return a.mean(axis, dtype, out, keepdims)


def amax(a, axis=None, out=None, keepdims=False):
    return a.max(axis, out, keepdims)


max = amax  # noqa: A001


def amin(a, axis=None, out=None, keepdims=False):
    return a.min(axis, out, keepdims)


min = amin  # noqa: A001


# ================================================================== linear algebra
# CuPy 14.2.0's routing (cupy/_core/_routines_linalg.pyx at tag v14.2.0), followed dtype by dtype:
# - at most 2-D (`matmul` line 821, `if ndim <= 2` line 856 -> `dot` line 475 -> `tensordot_core`
#   line 541): integers run CuPy's integer GEMM kernel (line 621), everything else cuBLAS
#   `gemmEx` (tensordot_core_v11, line 702; on ROCm the branch from line 635, through a hipBLAS
#   shim that has no bfloat16 type: see cuda/cublas.py);
# - 3-D and more: the operands are cast to promote_types (float16 computes as float32, line
#   900); a dtype not in 'efdFD' goes to the integer GEMM kernel (line 992), whose module is
#   compiled for integer types only and looked up by `get_typename(dtype.char)` (line 301): for
#   bfloat16, whose char is 'E', that is `numpy.dtype('E')` (_scalar.pyx line 107 ->
#   _dtype.pyx get_dtype), which raises `TypeError: data type 'E' not understood`. The rest runs
#   cuBLAS `gemmStridedBatchedEx` (line 1014), or the pointer-array `?gemmBatched` when a batch
#   dimension broadcasts (line 1031 on).
def _integer_gemm_kernel(dtype):
    """The integer GEMM kernel's name lookup (get_typename(dtype.char), _routines_linalg.pyx line 301)."""
    np.dtype(dtype.char)  # bfloat16: TypeError("data type 'E' not understood"), as on a GPU
    if dtype.kind == "b":
        raise NotImplementedError("a boolean matmul (CuPy's integer GEMM module has no bool instance)")


def _gemm_ex_2d(dtype):
    """What tensordot_core does for a float dtype; on ROCm CuPy's hipBLAS shim aborts on bfloat16."""
    if cuda.runtime.is_hip and dtype == _ML_BF16:
        from cupy.cuda import cublas

        cublas._hip_shim(cuda.runtime.CUDA_R_16BF, cuda.runtime.CUDA_R_16BF, cuda.runtime.CUDA_R_16BF,
                         cuda.runtime.CUDA_R_32F, cublas.CUBLAS_GEMM_DEFAULT)


_CUDA_TYPES = {"float16": 2, "float32": 0, "float64": 1, "complex64": 4, "complex128": 5, "bfloat16": 14}


def _to_cublas(x, trans):
    """_mat_to_cublas_contiguous (_routines_linalg.pyx line 461): an F-contiguous x as it is, else
    x made C-contiguous (a copy when it is not) and the transpose flag flipped; with its ld."""
    item = x.dtype.itemsize
    if x._a.flags.f_contiguous:
        return x, trans, builtins.max(x.strides[1] // item, x.shape[0])
    if not x._a.flags.c_contiguous:
        x = _device_copy(np.ascontiguousarray(x._a))
    return x, 1 - trans, x.strides[0] // item


def _tensordot_core_v11(a, b, res, out):
    """A 2-D float product as CuPy 14.2 runs it on CUDA (`dot` line 475, `tensordot_core` line 541,
    `tensordot_core_v11` line 702): operands cast to the result dtype (line 580), laid out for cuBLAS
    (copied when neither C- nor F-contiguous), then one cuBLAS gemmEx with the compute type of
    `get_compute_type` (line 448: COMPUTE_TYPE_DEFAULT, or TF32 for float32 when CUPY_TF32 > 0) ->
    CUBLAS_COMPUTE_32F (16-bit and 32-bit floats), CUBLAS_COMPUTE_32F_FAST_TF32, CUBLAS_COMPUTE_64F;
    algo CUBLAS_GEMM_DEFAULT_TENSOR_OP from compute capability 8.0 (line 742)."""
    from cupy.cuda import cublas

    M, K = a.shape if a.ndim == 2 else (1, a.shape[0])
    N = b.shape[1] if b.ndim == 2 else 1
    ret_shape = tuple(a.shape[:-1]) + tuple(b.shape[1:])
    if a.size == 0 or b.size == 0 or (M == 1 and N == 1):  # zeros, or CuPy's elementwise mul-sum (line 560)
        result = np.matmul(a._a.astype(np.float32 if _is_half(res) else res), b._a.astype(np.float32 if _is_half(res) else res))
        return _device_copy(np.asarray(result).astype(res).reshape(ret_shape))
    a2 = _device_copy(a._a.astype(res)) if a.dtype != res else a
    b2 = _device_copy(b._a.astype(res)) if b.dtype != res else b
    a2 = a2.reshape(M, K).transpose()  # dot rolls the summed axis first (line 516): [k, n] and [k, m]
    b2 = b2.reshape(K, N)
    a2, transa, lda = _to_cublas(a2, 0)
    b2, transb, ldb = _to_cublas(b2, 1)
    shares = out is not None and (np.may_share_memory(out._a, a._a) or np.may_share_memory(out._a, b._a))
    c = ndarray((M, N), res) if out is None or shares else out
    t = _CUDA_TYPES[res.name]
    tf32 = res.char in "fF" and int(os.getenv("CUPY_TF32", "0")) > 0
    if res.char in "dD":
        compute, one, zero = cublas.CUBLAS_COMPUTE_64F, np.ones(1, np.float64), np.zeros(1, np.float64)
    else:
        compute = cublas.CUBLAS_COMPUTE_32F_FAST_TF32 if tf32 else cublas.CUBLAS_COMPUTE_32F
        one, zero = np.ones(1, np.float32), np.zeros(1, np.float32)
    if res.kind == "c":
        one, zero = one.astype(np.complex128 if res.char == "D" else np.complex64), zero.astype(np.complex128 if res.char == "D" else np.complex64)
    major = int(cuda.Device().compute_capability[:-1])
    algo = cublas.CUBLAS_GEMM_DEFAULT_TENSOR_OP if major >= 8 else cublas.CUBLAS_GEMM_DEFAULT
    cublas.gemmEx(cuda.get_cublas_handle(), transb, transa, N, M, K, one.ctypes.data, b2.data.ptr, t, ldb,
                  a2.data.ptr, t, lda, zero.ctypes.data, c.data.ptr, t, N, compute, algo)
    if c is not out and out is not None:
        if not _memory.META:
            out._a[...] = c._a
        return out
    return c.reshape(ret_shape) if c.shape != ret_shape else c


def matmul(a, b, out=None, dtype=None):
    """CuPy's matmul: the result dtype is promote_types of the operands (bfloat16 @ bfloat16 is
    bfloat16, computed with float32 accumulation and rounded once), routed as CuPy routes it."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        raise TypeError(f"Unsupported type {type(a if isinstance(a, np.ndarray) else b)}")
    if not isinstance(a, ndarray) or not isinstance(b, ndarray) or not a.ndim or not b.ndim:
        raise ValueError("Scalar operands are not allowed, use '*' instead")
    if dtype is not None:
        raise NotImplementedError("matmul(dtype=...) takes CuPy's generic gufunc path, which the stand-in does not model")
    nd = builtins.max(a.ndim, b.ndim)
    batch_a, batch_b = a.shape[:-2] if a.ndim > 1 else (), b.shape[:-2] if b.ndim > 1 else ()
    use_broadcast = nd > 2 and (len(batch_a) != len(batch_b) or any(x != y for x, y in zip(batch_a, batch_b)))
    if _record.active is not None:
        _record.note("matmul", _record.arg(a), _record.arg(b), *([f"out={_record.arg(out)}"] if out is not None else []),
                     *(["bcast"] if use_broadcast else []))
    res = np.promote_types(a.dtype, b.dtype)
    k_a, k_b = a.shape[-1], b.shape[-2] if b.ndim > 1 else b.shape[0]
    if k_a != k_b:
        raise ValueError(f"shapes ({','.join(map(str, a.shape))}) and ({','.join(map(str, b.shape))}) not aligned")
    work = res
    if nd <= 2:
        if res.kind in "biu":
            _integer_gemm_kernel(res)
        else:
            _gemm_ex_2d(res)
            if not cuda.runtime.is_hip:
                if out is None or (out.flags.c_contiguous and out.dtype == res):  # line 857
                    if out is not None and out.size != a.size // a.shape[-1] * (b.shape[1] if b.ndim == 2 else 1):
                        raise ValueError("Output array has an invalid size")
                    return _tensordot_core_v11(a, b, res, out)
                if not isinstance(out, ndarray):
                    raise TypeError(f"Output arrays must be cupy.ndarray, got {type(out)}")
                c = _tensordot_core_v11(a, b, res, None)  # into a new array, then elementwise_copy (line 863)
                _check_same_kind(res, out.dtype, "out dtype")
                if not _memory.META:
                    out._a[...] = c._a.astype(out.dtype, copy=False)
                return out
    else:
        work = np.dtype(np.float32) if res == np.float16 else res
        try:
            np.broadcast_shapes(batch_a, batch_b)
        except ValueError:
            raise ValueError("operands could not be broadcast together with remapped shapes") from None
        if work.char not in "efdFD":
            _integer_gemm_kernel(work)
    if work.kind not in "biu":
        _cublas_call(a, b, work, nd)
    if _memory.META:
        sa = a.shape if a.ndim > 1 else (1,) + a.shape
        sb = b.shape if b.ndim > 1 else b.shape + (1,)
        shape = tuple(np.broadcast_shapes(sa[:-2], sb[:-2])) + (sa[-2], sb[-1])
        shape = shape[:-2] + shape[-2:-1] * (a.ndim > 1) + shape[-1:] * (b.ndim > 1)
        if out is not None:
            _check_same_kind(res, out.dtype, "out dtype")
            if out.shape != shape:
                raise ValueError("Output array has an invalid size")
        return _meta_result(shape, res, out, "matmul")
    if _is_half(work):
        work = np.dtype(np.float32)  # cuBLAS with CUBLAS_COMPUTE_32F: float32 products and sums
    result = np.matmul(a._a.astype(work, copy=False), b._a.astype(work, copy=False)).astype(res, copy=False)
    if out is None:
        return _device_copy(result)
    if not isinstance(out, ndarray):
        raise TypeError(f"Output arrays must be cupy.ndarray, got {type(out)}")
    if out.shape != result.shape:
        raise ValueError("Output array has an invalid size")
    _check_same_kind(res, out.dtype, "out dtype")
    out._a[...] = result
    return out


def _cublas_call(a, b, work, nd):
    """Tell the cuBLAS model which GEMM CuPy 14.2 calls here (`cublas.called`, for traces), where the
    stand-in computes the product itself instead of calling its cuBLAS binding: batched,
    `gemmStridedBatchedEx` with the legacy cudaDataType of the (float16: float32) work dtype as
    compute type (_routines_linalg.pyx line 1014); at most 2-D (on ROCm only: on CUDA
    `_tensordot_core_v11` calls the binding's gemmEx, which reports itself), `gemmEx` with A = B = C
    of the dtype and CUBLAS_COMPUTE_32F for 16- and 32-bit floats (line 702)."""
    from cupy.cuda import cublas

    sa = a.shape if a.ndim > 1 else (1,) + a.shape
    sb = b.shape if b.ndim > 1 else b.shape + (1,)
    m, k, n = sa[-2], sa[-1], sb[-1]
    batch = int(np.prod(np.broadcast_shapes(sa[:-2], sb[:-2]), dtype=np.int64)) if nd > 2 else 1
    t = cublas._cuda_type(work)
    # cuBLAS is column-major: the row-major m x n product is its n x m one (operands swapped)
    if nd <= 2:
        compute = cublas.CUBLAS_COMPUTE_64F if work.itemsize == 8 and work.kind == "f" else cublas.CUBLAS_COMPUTE_32F
        cublas.called("gemmEx", batch, n, m, k, t, t, t, compute)
    else:
        cublas.called("gemmStridedBatchedEx", batch, n, m, k, t, t, t, t)


def dot(a, b, out=None):
    """cupy.dot for at most 2-D operands, where it is matmul's route (N-D dot is a tensordot, not modelled)."""
    if a.ndim > 2 or b.ndim > 2:
        raise NotImplementedError("cupy.dot of arrays of more than 2 dimensions is not modelled by the stand-in")
    return matmul(a, b, out)


# ================================================================== creation and manipulation
def empty(shape, dtype=float, order="C"):
    if _record.active is not None:
        _record.note("empty", np.dtype(dtype).name)
    return ndarray(shape, dtype)


def zeros(shape, dtype=float, order="C"):
    if _record.active is not None:
        _record.note("zeros", np.dtype(dtype).name)
    out = ndarray(shape, dtype)
    if not _memory.META:
        out._a[...] = 0
    return out


def ones(shape, dtype=float, order="C"):
    out = ndarray(shape, dtype)
    if not _memory.META:
        out._a[...] = 1
    return out


def full(shape, fill_value, dtype=None, order="C"):
    out = ndarray(shape, np.result_type(fill_value) if dtype is None else dtype)
    if not _memory.META:
        out._a[...] = fill_value
    return out


def empty_like(a, dtype=None, order="K", subok=None, shape=None):
    return empty(a.shape if shape is None else shape, a.dtype if dtype is None else dtype)


def zeros_like(a, dtype=None, order="K", subok=None, shape=None):
    return zeros(a.shape if shape is None else shape, a.dtype if dtype is None else dtype)


def ones_like(a, dtype=None, order="K", subok=None, shape=None):
    return ones(a.shape if shape is None else shape, a.dtype if dtype is None else dtype)


def array(obj, dtype=None, copy=True, order="K", ndmin=0):
    if isinstance(obj, ndarray):
        return obj.astype(obj.dtype if dtype is None else dtype, copy=copy)
    if isinstance(obj, (list, tuple)) and any(isinstance(o, ndarray) for o in obj):
        return stack(obj).astype(dtype or result_type(*obj), copy=False)
    cuda.graph.host_transfer(cuda.get_current_stream(), "H2D")  # core.pyx:2928 (copy_from_host_async)
    if _memory.META:  # the host array's shape and dtype; nothing is copied
        host = np.asarray(obj)
        shape = (1,) * builtins.max(0, ndmin - host.ndim) + host.shape
        return _new(shape, host.dtype if dtype is None else np.dtype(dtype))
    host = np.array(obj, dtype=dtype, ndmin=ndmin)  # host -> device: an explicit transfer
    return _device_copy(host)


def asarray(a, dtype=None, order=None):
    return array(a, dtype, copy=False)


def ascontiguousarray(a, dtype=None):
    if not isinstance(a, ndarray):
        raise TypeError(f"Argument 'a' has incorrect type (expected cupy.ndarray, got {type(a).__name__})")
    dt = a.dtype if dtype is None else np.dtype(dtype)
    if a.flags.c_contiguous and dt == a.dtype:
        return a
    if _memory.META:
        return _new(a.shape, dt)
    return _device_copy(np.ascontiguousarray(a._a, dtype=dt))


def asnumpy(a, stream=None, order="C", out=None, *, blocking=True):
    if isinstance(a, ndarray):
        return a.get(stream=stream, order=order, out=out, blocking=blocking)
    return np.asarray(a, order=order)


def get_array_module(*args):
    return _module() if any(isinstance(a, ndarray) for a in args) else np


def _module():
    import sys

    return sys.modules[__name__]


def arange(start, stop=None, step=1, dtype=None):
    return _device_copy(np.arange(start, stop, step, dtype=dtype) if stop is not None else np.arange(start, dtype=dtype))


def _devices(arrays):
    for a in arrays:
        if not isinstance(a, ndarray):
            raise TypeError(f"Only cupy arrays can be concatenated, got {type(a)}")
    return [a._a for a in arrays]


def _joined(np_join, arrays, axis, out, dtype):
    if _record.active is not None:
        _record.note(np_join.__name__, *sorted({_record.arg(a) for a in arrays}))
    if _memory.META:  # NumPy's shape and dtype rules, on zero-byte stand-ins of the operands
        _devices(list(arrays))
        dt = np.result_type(*[a.dtype for a in arrays]) if dtype is None else np.dtype(dtype)
        shape = np_join([np.empty(a.shape, np.dtype([])) for a in arrays], axis=axis).shape
        return _meta_result(shape, dt, out, np_join.__name__)
    host = np_join(_devices(list(arrays)), axis=axis, dtype=dtype)
    if out is None:
        return _device_copy(host)
    out._a[...] = host
    return out


def concatenate(arrays, axis=0, out=None, dtype=None):
    return _joined(np.concatenate, arrays, axis, out, dtype)


def stack(arrays, axis=0, out=None, dtype=None):
    return _joined(np.stack, arrays, axis, out, dtype)


# where's loop table has no bfloat16 loop (cupy/_sorting/search.py at v14.2.0, `_where_ufunc`,
# line 167): bfloat16 operands take the first loop they cast to safely, '?ff->f', so the result is
# float32
_WHERE = [np.dtype(c) for c in "?bBhHiIlLqQefdFD"]


def where(condition, x=None, y=None):
    if (x is None) != (y is None):
        raise ValueError("Must provide both 'x' and 'y' or neither.")
    if x is None and y is None:
        cuda.graph.host_transfer(cuda.get_current_stream(), "D2H")  # nonzero: its size is read on the host
        if _memory.META:
            raise NotImplementedError("cupy.where(condition) (nonzero): its result's shape depends on values")
        return tuple(_device_copy(i) for i in np.nonzero(condition._a))
    if _record.active is not None:
        _note_call("where", (condition, x, y))
    operands = [_Operand(x), _Operand(y)]
    loop = _select_loop("where", _WHERE, operands)
    if not isinstance(condition, ndarray):
        raise TypeError(f"Unsupported type {type(condition)}")
    if _memory.META:
        return _new(np.broadcast_shapes(*(v.shape for v in (condition, x, y) if isinstance(v, ndarray))), loop)
    xv, yv = _compute(loop, [o.value for o in operands])
    return _device_copy(np.where(condition._a.astype(bool), xv, yv).astype(loop, copy=False))


def transpose(a, axes=None):
    return a.transpose(axes) if axes is not None else a.transpose()


def reshape(a, newshape, order="C"):
    return a.reshape(newshape, order=order)


def copyto(dst, src, casting="same_kind"):
    if isinstance(src, np.ndarray):
        raise TypeError(f"Unsupported type {type(src)}")
    if _memory.META:
        np.broadcast_to(np.empty(np.shape(src), np.dtype([])), dst.shape)
        return
    dst._a[...] = src._a if isinstance(src, ndarray) else src


def allclose(a, b, rtol=1e-05, atol=1e-08, equal_nan=False):
    if _memory.META:
        return _new((), np.dtype(bool))
    return _device_copy(np.asarray(np.allclose(_devices([a])[0], _devices([b])[0], rtol, atol, equal_nan)))


def isscalar(x):
    return np.isscalar(x)


class _Random:
    """cupy.random's generator functions that bench/ uses (drawn on the host, then copied)."""

    def __init__(self):
        self._rng = np.random.default_rng(0)

    def seed(self, seed=None):
        self._rng = np.random.default_rng(seed)

    def standard_normal(self, size=None, dtype=float):
        return _device_copy(self._rng.standard_normal(size, dtype=np.dtype(dtype)))

    def random(self, size=None, dtype=float):
        return _device_copy(self._rng.random(size, dtype=np.dtype(dtype)))

    def randint(self, low, high=None, size=None, dtype=int):
        return _device_copy(self._rng.integers(low, high, size, dtype=dtype))


random = _Random()


# ================================================================== kernels
from cupy._kernel import RawKernel, RawModule  # noqa: E402,F401

# ================================================================== order tracking (cuda/_order.py)
from cupy import _tracked  # noqa: E402

_tracked.instrument(globals())
