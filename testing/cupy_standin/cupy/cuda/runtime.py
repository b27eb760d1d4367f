"""`cupy.cuda.runtime` of the stand-in: the device count and properties of a chosen GPU model.

BOOSTMPI_STANDIN_GPU selects it: a100 (default), h100 or mi250x (one GCD of an MI250X, as ROCm
shows it: a 64-wide wavefront, and no `sharedMemPerBlockOptin` key). The numbers are the vendors'
published figures for these parts; the project reads warpSize, multiProcessorCount and the
shared-memory limits.
"""

import os

GiB = 2**30

DEVICES = {
    "a100": dict(count=4, is_hip=False, props={
        "name": b"NVIDIA A100-SXM4-40GB", "totalGlobalMem": 40 * GiB, "multiProcessorCount": 108,
        "warpSize": 32, "maxThreadsPerBlock": 1024, "maxThreadsPerMultiProcessor": 2048,
        "sharedMemPerBlock": 48 * 1024, "sharedMemPerBlockOptin": 163 * 1024,
        "sharedMemPerMultiprocessor": 164 * 1024, "regsPerBlock": 65536, "regsPerMultiprocessor": 65536,
        "major": 8, "minor": 0, "clockRate": 1410000, "memoryClockRate": 1215000, "memoryBusWidth": 5120,
        "l2CacheSize": 40 * 2**20, "maxBlocksPerMultiProcessor": 32,
    }),
    "h100": dict(count=4, is_hip=False, props={
        "name": b"NVIDIA H100 80GB HBM3", "totalGlobalMem": 80 * GiB, "multiProcessorCount": 132,
        "warpSize": 32, "maxThreadsPerBlock": 1024, "maxThreadsPerMultiProcessor": 2048,
        "sharedMemPerBlock": 48 * 1024, "sharedMemPerBlockOptin": 227 * 1024,
        "sharedMemPerMultiprocessor": 228 * 1024, "regsPerBlock": 65536, "regsPerMultiprocessor": 65536,
        "major": 9, "minor": 0, "clockRate": 1980000, "memoryClockRate": 2619000, "memoryBusWidth": 5120,
        "l2CacheSize": 50 * 2**20, "maxBlocksPerMultiProcessor": 32,
    }),
    "mi250x": dict(count=8, is_hip=True, props={
        "name": b"AMD Instinct MI250X", "gcnArchName": b"gfx90a:sramecc+:xnack-", "totalGlobalMem": 64 * GiB,
        "multiProcessorCount": 110, "warpSize": 64, "maxThreadsPerBlock": 1024,
        "maxThreadsPerMultiProcessor": 2048, "sharedMemPerBlock": 64 * 1024,
        "maxSharedMemoryPerMultiProcessor": 64 * 1024, "regsPerBlock": 65536, "major": 9, "minor": 0,
        "clockRate": 1700000, "memoryClockRate": 1600000, "memoryBusWidth": 4096, "l2CacheSize": 8 * 2**20,
    }),
}


def model():
    name = os.environ.get("BOOSTMPI_STANDIN_GPU", "a100").lower()
    if name not in DEVICES:
        raise ValueError(f"BOOSTMPI_STANDIN_GPU={name!r}: expected one of {', '.join(DEVICES)}")
    return DEVICES[name]


is_hip = model()["is_hip"]

# cudaDataType_t values (CUDA's library_types.h; CuPy's runtime.pxd exports the same names)
CUDA_R_32F, CUDA_R_64F, CUDA_R_16F, CUDA_R_8I, CUDA_C_32F, CUDA_C_64F, CUDA_C_16F, CUDA_C_8I = range(8)
CUDA_R_32I, CUDA_R_16BF = 10, 14


# cudaStreamCaptureMode (CuPy's runtime.pxd exports these names; CuPy's begin_capture defaults to relaxed)
streamCaptureModeGlobal, streamCaptureModeThreadLocal, streamCaptureModeRelaxed = 0, 1, 2

# cudaError_t values and the runtime's strings for them (cudaGetErrorName / cudaGetErrorString; the
# codes as CUDA's driver_types.h numbers them, e.g.
# https://docs.rs/crseo-sys/latest/crseo_sys/constant.cudaError_cudaErrorStreamCaptureInvalidated.html).
# HIP numbers these the same (hipErrorStreamCaptureUnsupported = 900, ...) with a `hip` prefix.
_ERRORS = {
    401: ("ErrorIllegalState", "the operation cannot be performed in the present state"),
    900: ("ErrorStreamCaptureUnsupported", "operation not permitted when stream is capturing"),
    901: ("ErrorStreamCaptureInvalidated", "operation failed due to a previous error during capture"),
    903: ("ErrorStreamCaptureUnmatched", "capture was not initiated in this stream"),
    904: ("ErrorStreamCaptureUnjoined", "capture sequence contains a fork that was not joined to the primary stream"),
    906: ("ErrorStreamCaptureImplicit", "operation would make the legacy stream depend on a capturing blocking stream"),
    907: ("ErrorCapturedEvent", "operation not permitted on an event last recorded in a capturing stream"),
    999: ("ErrorUnknown", "unknown error"),
}
errorIllegalState, errorStreamCaptureUnsupported, errorStreamCaptureInvalidated = 401, 900, 901
errorStreamCaptureUnmatched, errorStreamCaptureUnjoined, errorStreamCaptureImplicit = 903, 904, 906
errorCapturedEvent, errorUnknown = 907, 999


class CUDARuntimeError(RuntimeError):
    """cupy_backends/cuda/api/runtime.pyx:128 at v14.2.0: made from a status code, with the message
    '<name>: <string>' (`status` kept); the stand-in's older uses pass a message of their own."""

    def __init__(self, status):
        if isinstance(status, int):
            self.status = status
            name, text = _ERRORS[status]
            status = f"{'hip' if is_hip else 'cuda'}{name}: {text}"
        super().__init__(status)


def getDeviceCount():
    """The model's GPUs per node; BOOSTMPI_STANDIN_GPUS sets another count (a node of 8 A100s, say)."""
    return int(os.environ.get("BOOSTMPI_STANDIN_GPUS", model()["count"]))


def _check(device):
    if not 0 <= device < getDeviceCount():
        raise CUDARuntimeError("cudaErrorInvalidDevice: invalid device ordinal")


def getDeviceProperties(device):
    _check(device)
    return dict(model()["props"])


# PCI bus ids of a node's GPUs, in device order (distinct per device, as the start-up check needs)
_BUS_IDS = {"a100": ["0000:07:00.0", "0000:46:00.0", "0000:85:00.0", "0000:c7:00.0"],
            "h100": ["0000:19:00.0", "0000:3b:00.0", "0000:4c:00.0", "0000:5d:00.0"],
            "mi250x": ["0000:c1:00.0", "0000:c6:00.0", "0000:c9:00.0", "0000:ce:00.0", "0000:d1:00.0",
                       "0000:d6:00.0", "0000:d9:00.0", "0000:de:00.0"]}


def deviceGetPCIBusId(device):
    _check(device)
    import os

    return _BUS_IDS[os.environ.get("BOOSTMPI_STANDIN_GPU", "a100").lower()][device]


def getDevice():
    from cupy.cuda import Device

    return Device().id


def runtimeGetVersion():
    return 60200000 if is_hip else 12040


def driverGetVersion():
    return runtimeGetVersion()


def memGetInfo():
    from cupy._memory import get_default_memory_pool

    total = model()["props"]["totalGlobalMem"]
    return total - get_default_memory_pool().total_bytes(), total


def deviceGetPCIBusId(device):
    """A distinct PCI bus id per device, in the form CUDA gives it (start-up checks compare them)."""
    _check(device)
    return f"0000:{0x07 + 0x40 * device:02x}:00.0"
