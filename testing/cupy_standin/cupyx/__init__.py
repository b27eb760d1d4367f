"""`cupyx` of the CuPy stand-in: only `cupyx.profiler.time_range`."""
