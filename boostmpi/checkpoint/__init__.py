"""Checkpoints: the one package that writes and reads model.h5, optim.h5, state.json and the rank files
(docs/CHECKPOINTS.md), one module per concern:

  format.py    the names on disk, the COMPLETE checksum, HDF5's byte allowance
  layout.py    which rank writes which elements, the RankState it hands over, where they sit in its file
  writer.py    the rank files (direct I/O, from a kept layout or a snapshot image), the virtual files
  saving.py    `save` and `PendingSave`: collective, all-or-nothing, synchronous or in the background
  runs.py      a run's checkpoints folder: complete ones, `latest`, `resolve`, timelines, pruning
  reading.py   `verify` and `load` under any layout
  pins.py      a reader's pin on a checkpoint folder, which pruning respects
  held.py      a whole checkpoint read on one process, held against pruning (the user tools)

Callers use the names below (`from boostmpi import checkpoint as ckpt`; `ckpt.save`, `ckpt.load`); a
test that replaces a function replaces it in the module that calls it (`writer.write_at`).
"""

from boostmpi.checkpoint.format import (CHECKPOINT_ARG_HELP, FORMAT, FORMAT_VERSION, MARKER, Checksum,
                                        checkpoint_step, checkpoints_dir, file_digest, newer_format, rank_file_name,
                                        step_dir_name)
from boostmpi.checkpoint.layout import (RankState, estimate_bytes, global_rank_states, rank_pieces, rank_state,
                                        read_params, write_range)
from boostmpi.checkpoint.reading import (load, model_mismatch, open_model, read_moments, read_state,
                                         recorded_files, verify, verify_together, write_consolidated)
from boostmpi.checkpoint.runs import (complete_checkpoints, find_latest, is_complete, is_stale_temporary,
                                      move_aside, remove_stale_temporaries, resolve, stale_temporaries,
                                      wait_for_pruning, write_latest)
from boostmpi.checkpoint.saving import PendingSave, save
from boostmpi.checkpoint.held import HeldCheckpoint, hold
from boostmpi.checkpoint.pins import Pin, live_pins
from boostmpi.checkpoint.writer import (SPARE_IMAGES, SequentialWriter, file_record, rank_file_image,
                                        write_file_image, write_rank_file, write_virtual_files)

__all__ = [
    "CHECKPOINT_ARG_HELP", "FORMAT", "FORMAT_VERSION", "MARKER", "Checksum", "checkpoint_step", "checkpoints_dir",
    "file_digest", "newer_format", "rank_file_name", "step_dir_name",
    "RankState", "estimate_bytes", "global_rank_states", "rank_pieces", "rank_state", "read_params", "write_range",
    "load", "model_mismatch", "open_model", "read_moments", "read_state", "recorded_files", "verify",
    "verify_together", "write_consolidated",
    "complete_checkpoints", "find_latest", "is_complete", "is_stale_temporary", "move_aside",
    "remove_stale_temporaries", "resolve", "stale_temporaries", "wait_for_pruning", "write_latest",
    "PendingSave", "save", "HeldCheckpoint", "hold", "Pin", "live_pins",
    "SPARE_IMAGES", "SequentialWriter", "file_record", "rank_file_image", "write_file_image", "write_rank_file",
    "write_virtual_files",
]
