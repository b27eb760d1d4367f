"""`cupy.cuda` of the stand-in: devices, streams, events, the memory pool, NCCL (see cuda/nccl.py)."""

import contextlib
import threading

from cupy._memory import MemoryPointer, MemoryPool, PinnedMemoryPool  # noqa: F401
from cupy.cuda import runtime  # noqa: F401
from cupy.cuda._queue import Event, Stream, StandinDeadlock, get_current_stream, get_elapsed_time  # noqa: F401
from cupy.cuda import graph  # noqa: F401,E402
from cupy.cuda.graph import Graph  # noqa: F401,E402  (cupy/cuda/__init__.py exports it as cupy.cuda.Graph)

_local = threading.local()


@contextlib.contextmanager
def using_allocator(allocator=None):
    """cupy/cuda/__init__.py:162 at v14.2.0: a thread-local allocator for the arrays made inside
    (None: CuPy's raw allocator, which the stand-in does not have)."""
    from cupy import _memory

    if allocator is None:
        raise NotImplementedError("the stand-in has no raw (pool-less) allocator")
    previous = _memory._get_thread_local_allocator()
    _memory._set_thread_local_allocator(allocator)
    try:
        yield
    finally:
        _memory._set_thread_local_allocator(previous)


class Device:
    def __init__(self, device=None):
        self.id = getattr(_local, "device", 0) if device is None else int(device)

    def use(self):
        runtime._check(self.id)
        _local.device = self.id

    def synchronize(self):
        from cupy.cuda import _order, _queue

        from cupy.cuda import graph

        graph.check_device_sync()  # cudaDeviceSynchronize while a stream captures
        _queue._host_sync()
        _queue.wait_for({op.id for op in _queue._pending}, f"synchronize of device {self.id}")
        _queue._synced.update(_queue._done)
        _order.host_waits_all()

    @property
    def pci_bus_id(self):
        return runtime.deviceGetPCIBusId(self.id)

    @property
    def compute_capability(self):
        props = runtime.getDeviceProperties(self.id)
        return f"{props['major']}{props['minor']}"

    def __enter__(self):
        self._previous = Device().id
        self.use()
        return self

    def __exit__(self, *exc):
        _local.device = self._previous
        return False

    def __repr__(self):
        return f"<CUDA Device {self.id} (stand-in)>"


def is_available():
    return runtime.getDeviceCount() > 0


_cublas_handles = {}


def get_cublas_handle():
    """The current device's cuBLAS handle (cupy.cuda.device.get_cublas_handle), made once per device."""
    from cupy.cuda import cublas

    dev = Device().id
    if dev not in _cublas_handles:
        _cublas_handles[dev] = cublas.create()
    return _cublas_handles[dev]


def __getattr__(name):  # CuPy loads `cupy.cuda.cublas` on first access (cupy/cuda/__init__.py, v14.2.0 line 65)
    if name in ("cublas", "nvtx"):
        import importlib

        return importlib.import_module(f"cupy.cuda.{name}")
    raise AttributeError(f"module 'cupy.cuda' has no attribute {name!r}")
