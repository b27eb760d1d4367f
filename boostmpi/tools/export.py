"""`boostmpi export CHECKPOINT --to torch|safetensors|hf|h5 --out PATH`: the weights for other tools.

- torch: `torch.save` of a plain {name: tensor} dict under boostmpi's own names
  (`layers/<i>/<lin>/A` ...), orientation y = x @ W (nothing else pickled, so
  `torch.load(path, weights_only=True)` reads it); the configuration goes beside it in
  `<PATH without suffix>.json` ({"format", "step", "config"}). Needs PyTorch.
- safetensors: the same tensors and names in one safetensors file, written by the `safetensors`
  package (its NumPy API), the configuration in its metadata ({"format", "step", "config"}).
- hf: a folder that Hugging Face `transformers` loads as it is with
  `LlamaForCausalLM.from_pretrained(PATH)`: `config.json` (LLaMA: sizes, grouped-query heads,
  rope theta, RMSNorm epsilon, untied head) and `model.safetensors` under LLaMA's names, each
  linear weight [out, in]. `full` exports its weights; `svd` each pair multiplied out into its
  dense weight W = A @ B (in float64, then rounded once to the stored dtype), the same function
  exactly; `cola` is refused: silu(x @ A) @ B has no dense weight a LLaMA layer could hold. So is
  a model without the SiLU gate (`model.mlp_gate_act = false`), which LLaMA's MLP always applies.

- h5: a consolidated single-file copy of model.h5 (the same attributes and names, every tensor stored
  in the file instead of virtual datasets over the rank files), for sharing one file.

The `export` extra (`pip install -e '.[export]'` in a checkout) installs what torch, safetensors and
hf need (torch, safetensors, transformers).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np

from boostmpi import checkpoint as ckpt
from boostmpi.checkpoint import CHECKPOINT_ARG_HELP
from boostmpi.errors import UserError
from boostmpi.files import atomic_file, check_writable_parent, fsync_dir
from boostmpi.tools.loading import LoadedCheckpoint, load_checkpoint

if TYPE_CHECKING:
    import argparse

    from boostmpi.cli import Subparsers
    from boostmpi.config import ModelConfig

FORMATS = ("torch", "safetensors", "hf", "h5")
INSTALL_HINT = "install the export extra (pip install -e '.[export]' in a checkout)"


def register(subparsers: Subparsers) -> None:
    p = subparsers.add_parser("export", help="write a checkpoint's weights for PyTorch, safetensors, Hugging Face or as one HDF5 file",
                              description="Export a checkpoint's weights: boostmpi's names as a PyTorch state dict or "
                                          "a safetensors file, or a Hugging Face LLaMA folder (--to hf) that "
                                          "transformers loads as it is.",
                              epilog=f"The formats need optional packages: {INSTALL_HINT}.")
    p.add_argument("checkpoint", help=CHECKPOINT_ARG_HELP)
    p.add_argument("--to", required=True, choices=FORMATS, help="output format")
    p.add_argument("--out", required=True, metavar="PATH",
                   help="output file (model.pt, model.safetensors, model.h5), or for --to hf a folder that does not exist yet")
    p.set_defaults(func=run)


def _safetensors_numpy() -> ModuleType:
    try:
        import safetensors.numpy
    except ImportError as exc:
        raise UserError(f"this export needs the safetensors package, which is not importable ({exc}); "
                        f"{INSTALL_HINT}") from exc
    return safetensors.numpy


def write_safetensors(path: str, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, object]) -> None:
    """Write {name: np.ndarray} and {str: str} metadata as a safetensors file, atomically."""
    st = _safetensors_numpy()
    data = st.save({name: np.ascontiguousarray(value) for name, value in tensors.items()},
                   metadata={str(k): str(v) for k, v in metadata.items()})
    with atomic_file(path, "wb") as f:
        f.write(data)


def torch_sidecar_path(path: str) -> str:
    """Where the configuration of a torch export goes: the output path with .json for its suffix."""
    return os.path.splitext(path)[0] + ".json"


def write_torch(path: str, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, object]) -> str:
    """torch.save of {name: tensor}, the metadata as JSON beside it; returns the sidecar's path."""
    try:
        import torch
    except ImportError as exc:
        raise UserError(f"export --to torch needs PyTorch, which is not importable ({type(exc).__name__}: {exc}); "
                        f"{INSTALL_HINT}, or use --to safetensors") from exc
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


HF_LINEARS = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
              "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}


def hf_llama(model: ModelConfig, tensors: Mapping[str, np.ndarray]) -> tuple[dict[str, object], dict[str, np.ndarray]]:
    """(config.json dict, {HF name: tensor [out, in]}) of a `full` or `svd` model; UserError for the others."""
    if model.arch == "cola":
        raise UserError("--to hf cannot export arch = cola: silu(x @ A) @ B has no dense weight that a LLaMA "
                        "layer could hold; export --to safetensors or --to torch instead")
    if not model.mlp_gate_act:
        raise UserError("--to hf needs model.mlp_gate_act = true: LLaMA's MLP always applies SiLU to the gate")
    dtype = tensors["embed"].dtype

    def dense(prefix: str) -> np.ndarray:
        if model.arch == "full":
            return tensors[prefix + "/W"]
        product = tensors[prefix + "/A"].astype(np.float64) @ tensors[prefix + "/B"].astype(np.float64)
        return product.astype(dtype)

    weights = {"model.embed_tokens.weight": tensors["embed"], "model.norm.weight": tensors["final_norm"],
               "lm_head.weight": tensors["lm_head"].T}
    for i in range(model.n_layers):
        weights[f"model.layers.{i}.input_layernorm.weight"] = tensors[f"layers/{i}/attn_norm"]
        weights[f"model.layers.{i}.post_attention_layernorm.weight"] = tensors[f"layers/{i}/mlp_norm"]
        for name, hf in HF_LINEARS.items():
            weights[f"model.layers.{i}.{hf}.weight"] = dense(f"layers/{i}/{name}").T  # HF keeps [out, in]
    theta = float(model.rope_theta)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": model.vocab_size, "hidden_size": model.d_model, "intermediate_size": model.d_ff,
        "num_hidden_layers": model.n_layers, "num_attention_heads": model.n_heads,
        "num_key_value_heads": model.n_kv_heads, "head_dim": model.head_dim,
        "max_position_embeddings": model.seq_len, "rms_norm_eps": float(model.norm_eps),
        "rope_theta": theta, "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
        "torch_dtype": str(dtype), "dtype": str(dtype),
    }
    return config, {name: np.ascontiguousarray(w) for name, w in weights.items()}


def write_hf(out_dir: str, loaded: LoadedCheckpoint) -> int:
    """The Hugging Face folder (config.json + model.safetensors), made beside `out_dir` and renamed into place."""
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise UserError(f"--out {out_dir} already exists; --to hf writes a new folder (remove it or name another)")
    check_writable_parent(os.path.join(out_dir, "config.json") if os.path.isdir(out_dir) else out_dir, "--out")
    config, weights = hf_llama(loaded.cfg.model, loaded.tensors)
    parent = os.path.dirname(os.path.abspath(out_dir))
    tmp = os.path.join(parent, f".{os.path.basename(os.path.abspath(out_dir))}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        os.makedirs(tmp)
        write_safetensors(os.path.join(tmp, "model.safetensors"), weights, {"format": "pt"})
        with atomic_file(os.path.join(tmp, "config.json")) as f:
            json.dump(dict(config, boostmpi={"step": loaded.step, "arch": loaded.cfg.model.arch}), f, indent=1)
            f.write("\n")
        if os.path.isdir(out_dir):
            os.rmdir(out_dir)  # empty, checked above
        os.rename(tmp, out_dir)
        fsync_dir(parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return len(weights)


def run(args: argparse.Namespace) -> int:
    if args.to not in FORMATS:
        raise UserError(f"--to must be one of {', '.join(FORMATS)}, got {args.to!r}")
    if args.to != "hf":
        check_writable_parent(args.out, "--out")
    if args.to == "h5":
        with ckpt.hold(args.checkpoint) as held:
            ckpt.write_consolidated(args.out, held)
        print(f"wrote a single-file copy of model.h5 to {args.out}")
        return 0
    loaded = load_checkpoint(args.checkpoint)
    if args.to == "torch":
        sidecar = write_torch(args.out, loaded.tensors, {"format": "boostmpi", "step": loaded.step,
                                                         "config": loaded.saved_config})
        print(f"wrote {len(loaded.tensors)} tensors to {args.out} and the configuration to {sidecar}")
    elif args.to == "safetensors":
        write_safetensors(args.out, loaded.tensors, {"format": "boostmpi", "step": loaded.step,
                                                 "config": json.dumps(loaded.saved_config, sort_keys=True)})
        print(f"wrote {len(loaded.tensors)} tensors and the configuration to {args.out}")
    else:
        count = write_hf(args.out, loaded)
        print(f"wrote {args.out}/config.json and {args.out}/model.safetensors ({count} tensors, LLaMA names); "
              f"load it with transformers.LlamaForCausalLM.from_pretrained({args.out!r})")
    return 0
