"""`cupyx.profiler.time_range` of the stand-in, as CuPy 14.2.0 defines it (cupyx/profiler/_time_range.py):
a context manager and decorator that pushes an NVTX range on entry and pops it on exit (with
`sync`, after a device synchronize), refusing to run when NVTX is not available."""

import functools


class time_range:
    def __init__(self, message=None, color_id=None, argb_color=None, sync=False):
        from cupy.cuda import nvtx

        if not nvtx.available:
            raise RuntimeError("nvtx is not installed")
        if color_id is not None and argb_color is not None:
            raise ValueError("Only either color_id or argb_color can be specified")
        self.message, self.sync = message, sync
        self.color_id = -1 if color_id is None else color_id
        self.argb_color = argb_color

    def __enter__(self):
        from cupy.cuda import nvtx

        if self.message is None:
            raise ValueError("when used as a context manager, the message argument cannot be None")
        if self.sync:
            from cupy.cuda import Device

            Device().synchronize()
        if self.argb_color is not None:
            nvtx.RangePushC(self.message, self.argb_color)
        else:
            nvtx.RangePush(self.message, self.color_id)
        return self

    def __exit__(self, *exc):
        from cupy.cuda import nvtx

        if self.sync:
            from cupy.cuda import Device

            Device().synchronize()
        nvtx.RangePop()

    def __call__(self, func):
        @functools.wraps(func)
        def inner(*args, **kwargs):
            if self.message is None:
                self.message = func.__name__
            with self:
                return func(*args, **kwargs)
        return inner
