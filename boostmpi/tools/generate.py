"""`boostmpi generate CHECKPOINT --prompt TEXT`: sampling with a KV cache on one process.

The forward pass here is the model of the training engine written for incremental decoding: the keys
and values of every position already seen are kept per layer, so each new token costs one row
through the network plus one attention row over the cache. It reuses the layer math of
boostmpi.model.layers and reads the checkpoint's global tensors, so any layout's checkpoint works.

Context longer than seq_len: the model was trained on positions 0..seq_len-1 only, so a
context never goes past them. A prompt longer than seq_len keeps its last seq_len tokens; when
the context is full, it is cut to its last seq_len // 2 tokens, which are encoded again at
positions 0.. (a fresh cache), and decoding continues from there. Sampling stops early at
the tokenizer's end-of-text id; an empty prompt starts from it, i.e. at a document start.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from boostmpi.checkpoint import CHECKPOINT_ARG_HELP
from boostmpi.data.shards import resolve_shards
from boostmpi.data.tokenizer import ByteTokenizer, tokenizer_for_shards, tokenizer_from_name
from boostmpi.errors import UserError
from boostmpi.model import layers
from boostmpi.tools.loading import load_checkpoint

if TYPE_CHECKING:
    import argparse

    from numpy.typing import ArrayLike, DTypeLike

    from boostmpi.cli import Subparsers
    from boostmpi.config import Config, ModelConfig
    from boostmpi.data.tokenizer import Tokenizer


def register(subparsers: Subparsers) -> None:
    p = subparsers.add_parser(
        "generate", help="sample text from a checkpoint",
        description="Sample a continuation of a prompt from a checkpoint (one process, KV cache). The model sees "
                    "at most model.seq_len tokens, the positions it was trained on: a longer prompt keeps its last "
                    "seq_len tokens (the start is cut), and when the context is full it keeps its last seq_len // 2 "
                    "tokens and goes on from there.")
    p.add_argument("checkpoint", help=CHECKPOINT_ARG_HELP)
    p.add_argument("--prompt", required=True,
                   help="text to continue (empty: start a new document); only its last seq_len tokens are used")
    p.add_argument("--max-new-tokens", type=int, default=200, help="tokens to generate (default %(default)s)")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default %(default)s)")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens; 0 = all (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus: the smallest set of tokens with this much probability (default 1.0 = all)")
    p.add_argument("--seed", type=int, default=0, help="random seed of the sampler (default %(default)s)")
    p.add_argument("--tokenizer", default=None, metavar="SPEC",
                   help="byte, a tiktoken encoding or PATH.json (default: the one recorded with the training shards, else byte)")
    p.set_defaults(func=run)


# ---------------------------------------------------------------- the model with a KV cache

class KVCache:
    """Keys and values (after RoPE) of positions 0..length-1, per layer: [capacity, Hkv, Dh] each."""

    def __init__(self, n_layers: int, capacity: int, n_kv_heads: int, head_dim: int, dtype: DTypeLike) -> None:
        self.k = [np.zeros((capacity, n_kv_heads, head_dim), dtype=dtype) for _ in range(n_layers)]
        self.v = [np.zeros((capacity, n_kv_heads, head_dim), dtype=dtype) for _ in range(n_layers)]
        self.capacity = capacity
        self.length = 0


def cached_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, first_position: int) -> np.ndarray:
    """q [n, H, Dh] at positions first_position.., k, v [S, Hkv, Dh] at positions 0..S-1 -> o [n, H*Dh].

    Query j may read keys up to its own position first_position + j (causal); GQA: kv head
    h // G serves q head h, G = H / Hkv.
    """
    n, H, Dh = q.shape
    S, Hkv = k.shape[0], k.shape[1]
    G = H // Hkv
    qg = q.reshape(n, Hkv, G, Dh) * q.dtype.type(1.0 / np.sqrt(Dh))
    scores = np.einsum("nkgd,skd->kgns", qg, k)  # [Hkv, G, n, S]
    future = np.arange(S)[None, :] > (first_position + np.arange(n))[:, None]  # [n, S]
    scores[..., future] = -np.inf
    scores -= scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    return np.einsum("kgns,skd->nkgd", probs, v).reshape(n, H * Dh)


class Decoder:
    """The model on one process, fed a few tokens at a time through a KV cache."""

    def __init__(self, model_cfg: ModelConfig, tensors: Mapping[str, np.ndarray], dtype: DTypeLike = np.float32) -> None:
        self.m = model_cfg
        self.dtype = np.dtype(dtype)
        self.P = {name: np.asarray(t, dtype=self.dtype) for name, t in tensors.items()}
        self.cos, self.sin = layers.rope_tables(model_cfg.seq_len, model_cfg.head_dim, model_cfg.rope_theta, self.dtype)

    def new_cache(self) -> KVCache:
        m = self.m
        return KVCache(m.n_layers, m.seq_len, m.n_kv_heads, m.head_dim, self.dtype)

    def linear(self, i: int, name: str, x: np.ndarray) -> np.ndarray:
        P, prefix = self.P, f"layers/{i}/{name}"
        if self.m.arch == "full":
            return x @ P[prefix + "/W"]
        a = x @ P[prefix + "/A"]
        if self.m.arch == "cola":
            a = layers.silu_forward(a)
        return a @ P[prefix + "/B"]

    def forward(self, ids: Sequence[int], cache: KVCache) -> np.ndarray:
        """Logits [n, V] of the n tokens `ids` placed after the cache's positions; extends the cache."""
        m, P = self.m, self.P
        n, pos = len(ids), cache.length
        if pos + n > cache.capacity:
            raise ValueError(f"{pos} cached + {n} new positions exceed seq_len = {cache.capacity}")
        H, Hkv, Dh = m.n_heads, m.n_kv_heads, m.head_dim
        cos, sin = self.cos[pos:pos + n], self.sin[pos:pos + n]  # [n, 1, Dh]
        h = layers.embedding_forward(P["embed"], np.asarray(ids, dtype=np.int64))
        for i in range(m.n_layers):
            a, _ = layers.rmsnorm_forward(h, P[f"layers/{i}/attn_norm"], m.norm_eps)
            q = layers.rope_forward(self.linear(i, "q", a).reshape(n, H, Dh), cos, sin)
            cache.k[i][pos:pos + n] = layers.rope_forward(self.linear(i, "k", a).reshape(n, Hkv, Dh), cos, sin)
            cache.v[i][pos:pos + n] = self.linear(i, "v", a).reshape(n, Hkv, Dh)
            o = cached_attention(q, cache.k[i][:pos + n], cache.v[i][:pos + n], pos)
            h = h + self.linear(i, "o", o)
            x, _ = layers.rmsnorm_forward(h, P[f"layers/{i}/mlp_norm"], m.norm_eps)
            gated = layers.gate_forward(self.linear(i, "gate", x), self.linear(i, "up", x), m.mlp_gate_act)
            h = h + self.linear(i, "down", gated)
        cache.length = pos + n
        h, _ = layers.rmsnorm_forward(h, P["final_norm"], m.norm_eps)
        return h @ P["lm_head"]


# ---------------------------------------------------------------- sampling

def check_sampling(temperature: float, top_k: int, top_p: float, max_new_tokens: int) -> None:
    if not temperature >= 0:
        raise UserError(f"--temperature must be >= 0 (0 = greedy), got {temperature}")
    if top_k < 0:
        raise UserError(f"--top-k must be >= 0 (0 = no limit), got {top_k}")
    if not 0 < top_p <= 1:
        raise UserError(f"--top-p must be in (0, 1], got {top_p}")
    if max_new_tokens < 0:
        raise UserError(f"--max-new-tokens must be >= 0, got {max_new_tokens}")


def sample_token(logits: ArrayLike, rng: np.random.Generator, temperature: float = 0.8, top_k: int = 0,
                 top_p: float = 1.0) -> int:
    """One token id from logits [V]: greedy at temperature 0, else softmax(logits / temperature)
    restricted to the top_k most likely ids and then to the top_p nucleus."""
    logits = np.asarray(logits, dtype=np.float64)
    if temperature == 0:
        return int(np.argmax(logits))
    order = np.argsort(-logits, kind="stable")  # most likely first
    if top_k > 0:
        order = order[:top_k]
    # shifted before dividing: a temperature near zero (1e-320) sends every other logit to -inf, the most
    # likely to 0, the greedy limit, where logits / temperature would be inf - inf = NaN
    with np.errstate(over="ignore"):
        scaled = (logits[order] - logits[order].max()) / temperature
    probs = np.exp(scaled)
    probs /= probs.sum()
    if top_p < 1.0:
        # keep the most likely ids until their mass reaches top_p (at least one)
        keep = int(np.searchsorted(np.cumsum(probs), top_p)) + 1
        probs = probs[:keep] / probs[:keep].sum()
        order = order[:keep]
    return int(order[rng.choice(len(order), p=probs)])


def generate_ids(decoder: Decoder, prompt_ids: Sequence[int], max_new_tokens: int, sample: Callable[[np.ndarray], int],
                 stop_id: int | None = None) -> list[int]:
    """The new token ids after `prompt_ids` (non-empty); `sample(logits [V]) -> id`.

    Stops after `stop_id` (the end-of-text id) if it is sampled. The context slides as the
    module docstring says when it would pass seq_len.
    """
    T = decoder.m.seq_len
    keep = max(1, T // 2)
    context = list(prompt_ids)[-T:]
    cache = decoder.new_cache()
    logits = decoder.forward(context, cache)[-1]
    new = []
    for _ in range(max_new_tokens):
        token = sample(logits)
        new.append(token)
        if token == stop_id or len(new) == max_new_tokens:
            break
        context.append(token)
        if cache.length == T:  # no position left for the token: re-encode the recent half
            context = context[-keep:]
            cache = decoder.new_cache()
            logits = decoder.forward(context, cache)[-1]
        else:
            logits = decoder.forward([token], cache)[-1]
    return new


# ---------------------------------------------------------------- tokenizer and prompt

def checkpoint_tokenizer(cfg: Config, spec: str | None = None) -> Tokenizer:
    """The tokenizer named by `spec`, else the one recorded with the run's training shards, else byte."""
    if spec is not None:
        return tokenizer_from_name(spec)
    shards = cfg.data.builtin_dir if cfg.data.train == "builtin" else cfg.data.train
    if not os.path.isdir(shards):
        try:
            resolve_shards(shards)
        except UserError:
            print(f"note: the training shards {shards} are not here; using the byte tokenizer "
                  f"(choose one with --tokenizer)", file=sys.stderr)
            return ByteTokenizer()
    return tokenizer_for_shards(shards)


def encode_prompt(tokenizer: Tokenizer, prompt: str, vocab_size: int) -> list[int]:
    """Prompt ids, each below the model's vocabulary; an empty prompt starts a document (the eot id)."""
    ids = [int(i) for i in tokenizer.encode(prompt)] if prompt else [int(tokenizer.eot)]
    bad = next((position for position, i in enumerate(ids) if not 0 <= i < vocab_size), None)
    if bad is None:
        return ids
    # name the character when one alone encodes out of range (true for the byte tokenizer)
    for index, char in enumerate(prompt):
        if any(i >= vocab_size for i in tokenizer.encode(char)):
            raise UserError(f"the prompt's character {char!r} (U+{ord(char):04X}) at position {index} is outside the "
                            f"model's vocabulary of {vocab_size} ids with tokenizer {tokenizer.name}")
    raise UserError(f"the prompt's token {bad} has id {ids[bad]}, outside the model's vocabulary of {vocab_size} ids "
                    f"with tokenizer {tokenizer.name}")


def run(args: argparse.Namespace) -> int:
    check_sampling(args.temperature, args.top_k, args.top_p, args.max_new_tokens)
    if not 0 <= args.seed < 2**64:  # NumPy's generators take non-negative seeds; boostmpi's are 64-bit
        raise UserError(f"--seed must be between 0 and 2**64 - 1, got {args.seed}")
    loaded = load_checkpoint(args.checkpoint)
    cfg = loaded.cfg
    tokenizer = checkpoint_tokenizer(cfg, args.tokenizer)
    prompt_ids = encode_prompt(tokenizer, args.prompt, cfg.model.vocab_size)
    decoder = Decoder(cfg.model, loaded.tensors, np.dtype(cfg.train.dtype))
    rng = np.random.default_rng(args.seed)
    # ids the tokenizer cannot decode are never sampled (a model may have a padded vocabulary)
    usable = min(cfg.model.vocab_size, tokenizer.vocab_size)
    new = generate_ids(decoder, prompt_ids, args.max_new_tokens,
                       lambda logits: sample_token(logits[:usable], rng, args.temperature, args.top_k, args.top_p),
                       stop_id=tokenizer.eot)
    if new and new[-1] == tokenizer.eot:
        new.pop()  # the end of the document, not text
    print(args.prompt + tokenizer.decode(new))
    return 0
