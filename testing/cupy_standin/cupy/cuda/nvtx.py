"""`cupy.cuda.nvtx` of the stand-in: NVTX's named ranges (CuPy 14.2.0's binding,
cupy_backends/cuda/libs/nvtx.pyx: `RangePush(message, id_color=-1)`, `RangePushC(message,
color=0)`, `RangePop()`, `Mark(message, id_color=-1)`, `available`; on ROCm CuPy maps them to roctx).

Each thread keeps its stack of open ranges, as NVTX does. `events`, when a list, receives
("push", message), ("pop", message) and ("mark", message) in issue order, for traces that want to
read like a profile (bench/gpu_trace.py); `unbalanced` counts pops of an empty stack, which NVTX
ignores and a profile shows as a missing range.
"""

import threading

available = True
events = None
unbalanced = 0
_local = threading.local()


def _stack():
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


def _message(message):
    if not isinstance(message, str):
        raise TypeError(f"an NVTX message is a str, got {type(message).__name__}")  # the binding calls .encode()
    return message


def RangePush(message, id_color=-1):
    _stack().append(_message(message))
    if events is not None:
        events.append(("push", message))


def RangePushC(message, color=0):
    RangePush(message)


def RangePop():
    global unbalanced
    stack = _stack()
    if not stack:
        unbalanced += 1
        return
    message = stack.pop()
    if events is not None:
        events.append(("pop", message))


def Mark(message, id_color=-1):
    if events is not None:
        events.append(("mark", _message(message)))


def MarkC(message, color=0):
    Mark(message)
