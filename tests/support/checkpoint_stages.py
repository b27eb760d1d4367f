"""A checkpoint save that fails at a chosen stage, arranged from outside the product.

`at_stage(on_stage)` wraps the writer's functions so that `on_stage(stage)` runs:

- "rank file": once this rank's rank file is written (the synchronous writer, or the asynchronous
  save's snapshot image);
- "model.h5": once rank 0 has written the virtual files (model.h5, optim.h5);
- "marker": just before rank 0 writes the completion marker.

Whatever `on_stage` raises is what the save meets at that point; it may also kill the process.
"""

import contextlib
import os

from boostmpi.checkpoint import saving, writer
from boostmpi.checkpoint.format import MARKER


def _after(function, stage, on_stage):
    def wrapped(*args, **kwargs):
        result = function(*args, **kwargs)
        on_stage(stage)
        return result
    return wrapped


@contextlib.contextmanager
def at_stage(on_stage):
    originals = {name: getattr(writer, name) for name in ("write_rank_file", "write_file_image",
                                                          "write_virtual_files")}
    atomic_file = saving.atomic_file

    def atomic_file_then(path, *args, **kwargs):
        if os.path.basename(path) == MARKER:
            on_stage("marker")
        return atomic_file(path, *args, **kwargs)

    writer.write_rank_file = _after(originals["write_rank_file"], "rank file", on_stage)
    writer.write_file_image = _after(originals["write_file_image"], "rank file", on_stage)
    writer.write_virtual_files = _after(originals["write_virtual_files"], "model.h5", on_stage)
    saving.atomic_file = atomic_file_then
    try:
        yield
    finally:
        for name, function in originals.items():
            setattr(writer, name, function)
        saving.atomic_file = atomic_file
