"""`boostmpi export CHECKPOINT --to torch|safetensors --out PATH`: the weights for other tools.

Both formats hold the checkpoint's global tensors under the names of CONTRACT §3
(`layers/<i>/<lin>/A` ...), orientation y = x @ W, in the dtype they were stored in.

- torch: `torch.save` of a plain {name: tensor} dict (nothing else pickled, so
  `torch.load(path, weights_only=True)` reads it); the configuration goes beside it in
  `<PATH without suffix>.json` ({"format", "step", "config"}). Needs PyTorch.
- h5: a consolidated single-file copy of model.h5 (the same attributes and names, every tensor stored
  in the file instead of virtual datasets over the rank files), for sharing one file.
- safetensors: written here, no package needed: an 8-byte little-endian header length, a JSON
  header {name: {dtype, shape, data_offsets}, "__metadata__": {format, step, config}} padded with
  spaces to a multiple of 8 bytes, then the raw little-endian, C-order tensor bytes.
"""

import json
import os
import struct

import numpy as np

from boostmpi.files import atomic_file
from boostmpi.errors import UserError
from boostmpi.tools.loading import checkpoint_dir, load_checkpoint
from boostmpi.train import checkpoint as ckpt

FORMATS = ("torch", "safetensors", "h5")
SAFETENSORS_DTYPES = {np.dtype("float64"): "F64", np.dtype("float32"): "F32", np.dtype("float16"): "F16"}


def register(subparsers):
    p = subparsers.add_parser("export", help="write a checkpoint's weights as a PyTorch state dict, safetensors or one HDF5 file",
                              description="Export a checkpoint's weights (CONTRACT names) for PyTorch or safetensors readers.")
    p.add_argument("checkpoint", help="run directory (its latest checkpoint), checkpoint folder, or model.h5")
    p.add_argument("--to", required=True, choices=FORMATS, help="output format")
    p.add_argument("--out", required=True, metavar="PATH", help="output file (e.g. model.pt or model.safetensors)")
    p.set_defaults(func=run)


def write_safetensors(path, tensors, metadata):
    """Write {name: np.ndarray} and {str: str} metadata as a safetensors file, atomically."""
    header = {"__metadata__": {str(k): str(v) for k, v in metadata.items()}}
    arrays, offset = [], 0
    for name, value in tensors.items():
        value = np.asarray(value)
        if value.dtype not in SAFETENSORS_DTYPES:
            raise UserError(f"tensor {name} has dtype {value.dtype}, which this safetensors writer does not handle")
        array = np.ascontiguousarray(value, dtype=value.dtype.newbyteorder("<"))
        header[name] = {"dtype": SAFETENSORS_DTYPES[value.dtype], "shape": list(array.shape),
                        "data_offsets": [offset, offset + array.nbytes]}
        arrays.append(array)
        offset += array.nbytes
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)  # the tensor data starts 8-byte aligned
    with atomic_file(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for array in arrays:
            f.write(array.tobytes(order="C"))


def torch_sidecar_path(path):
    """Where the configuration of a torch export goes: the output path with .json for its suffix."""
    return os.path.splitext(path)[0] + ".json"


def write_torch(path, tensors, metadata):
    """torch.save of {name: tensor}, the metadata as JSON beside it; returns the sidecar's path."""
    try:
        import torch
    except ImportError as exc:
        raise UserError(f"export --to torch needs PyTorch, which is not importable ({type(exc).__name__}: {exc}); "
                        f"install torch or use --to safetensors") from exc
    sidecar = torch_sidecar_path(path)
    if os.path.abspath(sidecar) == os.path.abspath(path):
        raise UserError(f"--out {path} ends in .json, the name of the configuration written beside the tensors; "
                        f"name it e.g. model.pt")
    state_dict = {name: torch.from_numpy(np.ascontiguousarray(value)) for name, value in tensors.items()}
    with atomic_file(path, "wb") as f:
        torch.save(state_dict, f)
    with atomic_file(sidecar) as f:
        json.dump(metadata, f, indent=1)
        f.write("\n")
    return sidecar


def check_out_path(path):
    if os.path.isdir(path):
        raise UserError(f"--out {path} is a folder; give a file name, e.g. {os.path.join(path, 'model.pt')}")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise UserError(f"--out {path}: the folder {parent} does not exist")


def run(args):
    if args.to not in FORMATS:
        raise UserError(f"--to must be one of {', '.join(FORMATS)}, got {args.to!r}")
    check_out_path(args.out)
    if args.to == "h5":
        ckpt.write_consolidated(args.out, checkpoint_dir(args.checkpoint))
        print(f"wrote a single-file copy of model.h5 to {args.out}")
        return 0
    loaded = load_checkpoint(args.checkpoint)
    if args.to == "torch":
        sidecar = write_torch(args.out, loaded.tensors, {"format": "boostmpi", "step": loaded.step,
                                                         "config": loaded.saved_config})
        print(f"wrote {len(loaded.tensors)} tensors to {args.out} and the configuration to {sidecar}")
    else:
        write_safetensors(args.out, loaded.tensors, {"format": "boostmpi", "step": loaded.step,
                                                 "config": json.dumps(loaded.saved_config, sort_keys=True)})
        print(f"wrote {len(loaded.tensors)} tensors and the configuration to {args.out}")
    return 0
