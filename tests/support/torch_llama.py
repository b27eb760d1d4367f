"""PyTorch reference of the model of docs/FORMATS.md: the test oracle for our NumPy/CuPy code and
the "PyTorch CPU eager" baseline of the speed benchmark.

Written from docs/FORMATS.md alone, as if for one device, with autograd doing the backward pass.
Parameters use the checkpoint names and global shapes of docs/FORMATS.md, orientation y = x @ W.
Torch is a test/bench-only dependency: nothing under boostmpi/ imports this file.

Letters: B batch, T sequence, C d_model, H q heads, Hkv kv heads, Dh head dim, F d_ff, V vocab.
"""

import math

import numpy as np
import torch
import torch.nn.functional as F

LINEAR_NAMES = ("q", "k", "v", "o", "gate", "up", "down")
ATTENTION_LINEARS = ("q", "k", "v", "o")
ARCHS = ("full", "svd", "cola")

_DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}


def torch_dtype(dtype):
    """A torch dtype from a torch dtype or its name ("float64", "float32", "bfloat16")."""
    if isinstance(dtype, torch.dtype):
        return dtype
    return _DTYPES[dtype]


def gate_activation_on(model_cfg):
    """mlp_gate_act, defaulting as docs/FORMATS.md says when the key is absent."""
    return model_cfg.get("mlp_gate_act", model_cfg["arch"] != "cola")


def linear_rank(model_cfg, lin):
    """attn_rank for q, k, v, o and mlp_rank for gate, up, down (both fall back to rank)."""
    key = "attn_rank" if lin in ATTENTION_LINEARS else "mlp_rank"
    rank = model_cfg.get(key)
    return model_cfg["rank"] if rank is None else rank


def head_dims(model_cfg):
    """(H, Hkv, Dh), checking that the heads divide evenly."""
    C, H, Hkv = model_cfg["d_model"], model_cfg["n_heads"], model_cfg["n_kv_heads"]
    if C % H or H % Hkv or (C // H) % 2:
        raise ValueError(f"bad head layout: d_model={C}, n_heads={H}, n_kv_heads={Hkv} "
                         "(need d_model % n_heads == 0, n_heads % n_kv_heads == 0, even head dim)")
    return H, Hkv, C // H


def linear_shapes(model_cfg):
    """lin -> (in, out) for the seven linears of a layer."""
    C, F_ = model_cfg["d_model"], model_cfg["d_ff"]
    _, Hkv, Dh = head_dims(model_cfg)
    return {"q": (C, C), "k": (C, Hkv * Dh), "v": (C, Hkv * Dh), "o": (C, C),
            "gate": (C, F_), "up": (C, F_), "down": (F_, C)}


def param_shapes(model_cfg):
    """Parameter name -> global shape, in a fixed order (docs/FORMATS.md)."""
    arch = model_cfg["arch"]
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}")
    V, C = model_cfg["vocab_size"], model_cfg["d_model"]
    shapes = {"embed": (V, C)}
    for i in range(model_cfg["n_layers"]):
        shapes[f"layers/{i}/attn_norm"] = (C,)
        shapes[f"layers/{i}/mlp_norm"] = (C,)
        for lin, (d_in, d_out) in linear_shapes(model_cfg).items():
            if arch == "full":
                shapes[f"layers/{i}/{lin}/W"] = (d_in, d_out)
            else:
                r = linear_rank(model_cfg, lin)
                shapes[f"layers/{i}/{lin}/A"] = (d_in, r)
                shapes[f"layers/{i}/{lin}/B"] = (r, d_out)
    shapes["final_norm"] = (C,)
    shapes["lm_head"] = (C, V)
    return shapes


def init_params_numpy(model_cfg, seed):
    """Random float64 parameters for tests: dense N(0, 0.02^2), low-rank factors with the CoLA
    scale of docs/FORMATS.md. Unlike the training init, norm weights are 1 + N(0, 0.1^2) so that
    tests exercise them."""
    rng = np.random.default_rng(seed)
    params = {}
    for name, shape in param_shapes(model_cfg).items():
        if len(shape) == 1:
            params[name] = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name.endswith("/A") or name.endswith("/B"):
            lin = name.split("/")[2]
            d_in, d_out = linear_shapes(model_cfg)[lin]
            std = linear_rank(model_cfg, lin) ** -0.25 * (d_in + d_out) ** -0.25
            params[name] = std * rng.standard_normal(shape)
        else:
            params[name] = 0.02 * rng.standard_normal(shape)
    return params


def export_state_dict(params):
    """NumPy parameters -> torch tensors (copies), same names."""
    return {name: torch.tensor(np.asarray(value)) for name, value in params.items()}


def from_state_dict(state_dict):
    """Torch tensors -> NumPy float64 arrays, same names."""
    return {name: t.detach().cpu().double().numpy() for name, t in state_dict.items()}


def rms_norm(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight


def rope_cos_sin(T, Dh, theta, dtype):
    """cos, sin [T, Dh] of the rotate-half convention; angles computed in float64."""
    inv_freq = theta ** (-torch.arange(0, Dh, 2, dtype=torch.float64) / Dh)   # j < Dh/2
    angle = torch.arange(T, dtype=torch.float64)[:, None] * inv_freq[None, :]
    angle = torch.cat([angle, angle], dim=-1)
    return angle.cos().to(dtype), angle.sin().to(dtype)


def apply_rope(x, cos, sin):
    """x [B, T, heads, Dh]; cos, sin [T, Dh]. out = x*cos + cat([-x2, x1])*sin."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def causal_attention(q, k, v):
    """q [B, T, H, Dh], k and v [B, T, Hkv, Dh] -> [B, T, H, Dh].
    GQA: q head h reads kv head h // (H / Hkv), i.e. each kv head serves consecutive q heads."""
    T, H, Dh = q.shape[1], q.shape[2], q.shape[3]
    group = H // k.shape[2]
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))                  # [B, H, T, Dh]
    scores = q @ k.transpose(-1, -2) / math.sqrt(Dh)                  # [B, H, T, T]
    future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(diagonal=1)
    scores = scores.masked_fill(future, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return (probs @ v).transpose(1, 2)                                # [B, T, H, Dh]


class TorchLlama(torch.nn.Module):
    """The model of docs/FORMATS.md holding copies of `params` as nn.Parameters.

    `self.weights[name]` is the parameter called `name` in the checkpoint; after `loss.backward()`
    its `.grad` is the gradient in the same shape."""

    def __init__(self, model_cfg, params, dtype=torch.float64):
        super().__init__()
        self.cfg = dict(model_cfg)
        self.dtype = torch_dtype(dtype)
        self.n_heads, self.n_kv_heads, self.head_dim = head_dims(model_cfg)
        self.gate_act = gate_activation_on(model_cfg)
        expected = param_shapes(model_cfg)
        if set(params) != set(expected):
            missing, extra = sorted(set(expected) - set(params)), sorted(set(params) - set(expected))
            raise ValueError(f"parameter names do not match the config: missing {missing}, extra {extra}")
        weights = {}
        for name, shape in expected.items():
            value = np.asarray(params[name])
            if value.shape != shape:
                raise ValueError(f"{name}: shape {value.shape}, expected {shape}")
            weights[name] = torch.nn.Parameter(torch.tensor(value, dtype=self.dtype))
        # ParameterDict keys may not contain "."; the "/" of the checkpoint names is fine
        self.weights = torch.nn.ParameterDict(weights)
        cos, sin = rope_cos_sin(model_cfg["seq_len"], self.head_dim, model_cfg["rope_theta"], self.dtype)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def linear(self, layer, lin, x):
        w = self.weights
        prefix = f"layers/{layer}/{lin}"
        arch = self.cfg["arch"]
        if arch == "full":
            return x @ w[prefix + "/W"]
        if arch == "svd":
            return (x @ w[prefix + "/A"]) @ w[prefix + "/B"]
        return F.silu(x @ w[prefix + "/A"]) @ w[prefix + "/B"]

    def logits(self, x):
        """x LongTensor [B, T] -> logits [B, T, V]."""
        B, T = x.shape
        if T > self.cfg["seq_len"]:
            raise ValueError(f"sequence length {T} exceeds seq_len {self.cfg['seq_len']}")
        w, eps = self.weights, self.cfg["norm_eps"]
        H, Hkv, Dh = self.n_heads, self.n_kv_heads, self.head_dim
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        h = w["embed"][x]                                                 # [B, T, C]
        for i in range(self.cfg["n_layers"]):
            a = rms_norm(h, w[f"layers/{i}/attn_norm"], eps)
            q = self.linear(i, "q", a).view(B, T, H, Dh)
            k = self.linear(i, "k", a).view(B, T, Hkv, Dh)
            v = self.linear(i, "v", a).view(B, T, Hkv, Dh)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            o = causal_attention(q, k, v).reshape(B, T, H * Dh)
            h = h + self.linear(i, "o", o)
            m = rms_norm(h, w[f"layers/{i}/mlp_norm"], eps)
            g, u = self.linear(i, "gate", m), self.linear(i, "up", m)
            if self.gate_act:
                g = F.silu(g)
            h = h + self.linear(i, "down", g * u)
        h = rms_norm(h, w["final_norm"], eps)
        return h @ w["lm_head"]

    def forward(self, x, y):
        """Mean cross-entropy over all B*T target tokens."""
        logits = self.logits(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    def grads_numpy(self):
        """name -> gradient as a float64 NumPy array (zeros where no gradient reached)."""
        return {name: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().double().numpy()
                for name, p in self.weights.items()}


def as_tokens(tokens):
    return torch.as_tensor(np.asarray(tokens), dtype=torch.long)


def loss_and_grads(model_cfg, params, x, y, dtype="float64"):
    """One forward and backward pass: (loss as a float, name -> float64 NumPy gradient)."""
    model = TorchLlama(model_cfg, params, dtype=torch_dtype(dtype))
    loss = model(as_tokens(x), as_tokens(y))
    loss.backward()
    return loss.item(), model.grads_numpy()
