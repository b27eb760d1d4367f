"""RawModule / RawKernel of the stand-in: the kernel source itself, run by the CUDA execution harness.

The harness compiles exactly the text CuPy would hand NVRTC (with the same options) and runs the
grid under the CUDA execution model, checking every launch argument against the C signature by
CuPy's conversion rules. Here, before a launch, the limits a real launch would fail on: threads
per block, grid size, and dynamic shared memory (above 48 KiB only after opting in through
`max_dynamic_shared_size_bytes`, and never above the device's opt-in limit).
"""

from cupy.cuda import runtime

STATIC_SHARED_LIMIT = 48 * 1024


class CUDADriverError(RuntimeError):
    pass


def _dims(v, what):
    dims = (int(v),) if not isinstance(v, tuple) else tuple(int(d) for d in v)
    if not 1 <= len(dims) <= 3 or any(d < 1 for d in dims):
        raise CUDADriverError(f"CUDA_ERROR_INVALID_VALUE: {what} {v!r}")
    return dims


class RawKernel:
    def __init__(self, code=None, name=None, options=(), backend="nvrtc", *, _function=None):
        if _function is None:
            _function = RawModule(code=code, options=options).get_function(name)._function
        self._function = _function
        self.name = name
        self.max_dynamic_shared_size_bytes = 0

    @property
    def shared_size_bytes(self):
        """Static shared memory per block (the harness reads it from the compiled entry point)."""
        return self._function.shared_size_bytes

    @property
    def attributes(self):
        return {"max_dynamic_shared_size_bytes": self.max_dynamic_shared_size_bytes,
                "shared_size_bytes": self.shared_size_bytes}

    def __setattr__(self, key, value):
        if key == "max_dynamic_shared_size_bytes":
            limit = _optin_limit()
            if int(value) + (self.shared_size_bytes if "_function" in self.__dict__ else 0) > limit:
                raise CUDADriverError(f"CUDA_ERROR_INVALID_VALUE: max_dynamic_shared_size_bytes {value} (plus the "
                                      f"static shared memory) > {limit}")
            if "_function" in self.__dict__:
                self._function.max_dynamic_shared_size_bytes = int(value)
        object.__setattr__(self, key, value)

    def __call__(self, grid, block, args, *, shared_mem=0, stream=None, enable_cooperative_groups=False):
        props = runtime.getDeviceProperties(_current_device())
        grid, block = _dims(grid, "grid"), _dims(block, "block")
        threads = 1
        for d in block:
            threads *= d
        if threads > props["maxThreadsPerBlock"]:
            raise CUDADriverError(f"CUDA_ERROR_INVALID_VALUE: {threads} threads per block (at most {props['maxThreadsPerBlock']})")
        shared_mem = int(shared_mem)
        static = self.shared_size_bytes
        if self.max_dynamic_shared_size_bytes == 0 and static + shared_mem > STATIC_SHARED_LIMIT:
            raise CUDADriverError(f"CUDA_ERROR_INVALID_VALUE: {shared_mem} bytes of dynamic shared memory (+{static} "
                                  f"static) above {STATIC_SHARED_LIMIT} without opting in (max_dynamic_shared_size_bytes)")
        if self.max_dynamic_shared_size_bytes and shared_mem > self.max_dynamic_shared_size_bytes:
            raise CUDADriverError(f"CUDA_ERROR_INVALID_VALUE: {shared_mem} bytes of dynamic shared memory, more than "
                                  f"max_dynamic_shared_size_bytes = {self.max_dynamic_shared_size_bytes}")
        if not isinstance(args, tuple):
            raise TypeError("kernel arguments must be a tuple")
        from cupy import _memory

        if _memory.META:  # shapes only: the arguments are checked against the C signature, nothing runs
            from testing import cudaemu

            with cudaemu._lock:
                self._function._convert(args)
            return
        self._function(grid, block, args, shared_mem=shared_mem)


def _optin_limit():
    props = runtime.getDeviceProperties(_current_device())
    return props.get("sharedMemPerBlockOptin", props["sharedMemPerBlock"])


def _current_device():
    from cupy.cuda import Device

    return Device().id


class RawModule:
    def __init__(self, code=None, path=None, options=(), backend="nvrtc", translate_cucomplex=False,
                 enable_cooperative_groups=False, name_expressions=None, jitify=False):
        if code is None:
            raise NotImplementedError("the stand-in compiles source text only (code=...)")
        from testing import cudaemu

        self.code, self.options = code, tuple(options)
        self._module = cudaemu.Module(code, self.options)

    def compile(self, log_stream=None):
        """CuPy's RawModule.compile (cupy/_core/raw.pyx, v14.2.0): compile now rather than at the first
        launch. The harness compiled the text in __init__ already."""

    def get_function(self, name):
        kernel = RawKernel(_function=self._module.get_function(name))
        object.__setattr__(kernel, "name", name)
        return kernel
