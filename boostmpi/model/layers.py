"""The model's layers as forward/backward pairs, written for one device (no communication).

Letters: B batch, T time, C channels (d_model), H query heads, Hkv key/value heads, Dh head
dim, G = H/Hkv query heads per kv head, F d_ff, R rank, V vocabulary, N = B*T rows.
Every `*_backward` *accumulates* into the gradient arrays it is given (`+=`) and returns the
gradient of its input. Arrays may be NumPy or CuPy: `xp = get_array_module(x)`.
"""

import numpy as np

from boostmpi.backend import get_array_module


def _kernels_for(*arrays):
    """The fused CUDA kernels (boostmpi.gpu.kernels) when every array is a contiguous CuPy array of
    float32, else None: the NumPy code below is then the path (and the kernels' specification)."""
    if get_array_module(arrays[0]) is np:
        return None
    if not all(a.flags.c_contiguous and (a.dtype == np.float32 or a.dtype.name == "bfloat16") for a in arrays):
        return None
    from boostmpi.gpu import kernels

    return kernels


# ---------------------------------------------------------------- RMSNorm
# x [N, C], w [C] -> y [N, C]; rstd [N, 1] = 1/sqrt(mean(x^2) + eps)
def rmsnorm_forward(x, w, eps):
    k = _kernels_for(x, w)
    if k is not None and x.ndim == 2:
        y, rstd = k.rmsnorm_forward(x, w, eps)
        return y, rstd[:, None]
    xp = get_array_module(x)
    rstd = 1.0 / xp.sqrt(xp.mean(x * x, axis=-1, keepdims=True) + eps)
    return x * rstd * w, rstd


def rmsnorm_backward(dy, x, w, rstd, dw):
    k = _kernels_for(dy, x, w)
    if k is not None and x.ndim == 2:
        dx, dw_part = k.rmsnorm_backward(dy, x, w, get_array_module(x).ascontiguousarray(rstd.reshape(-1)))
        dw += dw_part
        return dx
    dyw = dy * w
    dw += (dy * x * rstd).sum(axis=0)
    proj = (dyw * x).mean(axis=-1, keepdims=True) * (rstd * rstd)
    return rstd * (dyw - x * proj)


# ---------------------------------------------------------------- SiLU and the gated product
def sigmoid(a):
    xp = get_array_module(a)
    return 1.0 / (1.0 + xp.exp(-a))


def silu_forward(a):
    k = _kernels_for(a)
    if k is not None:
        return k.silu_forward(a)
    return a * sigmoid(a)


def silu_backward(dz, a):
    k = _kernels_for(dz, a)
    if k is not None:
        return k.silu_backward(a, dz)
    s = sigmoid(a)
    return dz * s * (1.0 + a * (1.0 - s))


# y = act(g) * u, act = silu when `act`, identity otherwise. g, u [N, F]
def gate_forward(g, u, act):
    k = _kernels_for(g, u)
    if k is not None:
        return k.gate_forward(g, u, act)
    return (silu_forward(g) if act else g) * u


def gate_backward(dy, g, u, act):
    k = _kernels_for(dy, g, u)
    if k is not None:
        return k.gate_backward(g, u, dy, act)
    if act:
        s = sigmoid(g)
        ga = g * s
        return dy * u * s * (1.0 + g * (1.0 - s)), dy * ga
    return dy * u, dy * g


# ---------------------------------------------------------------- embedding
# table [V, C], ids [N] -> out [N, C]
def embedding_forward(table, ids):
    return table[ids]


def embedding_backward(dtable, ids, dout):
    xp = get_array_module(dout)
    if xp is np:
        np.add.at(dtable, ids, dout)
    else:
        xp.add.at(dtable, ids, dout)


# ---------------------------------------------------------------- RoPE (rotate-half convention)
def rope_tables(T, Dh, theta, dtype, xp=np):
    """cos, sin [T, 1, Dh] for positions 0..T-1 (computed in float64, then cast)."""
    inv_freq = theta ** (-np.arange(0, Dh, 2, dtype=np.float64) / Dh)
    angle = np.arange(T, dtype=np.float64)[:, None] * inv_freq[None, :]
    angle = np.concatenate([angle, angle], axis=-1)[:, None, :]
    return xp.asarray(np.cos(angle), dtype=dtype), xp.asarray(np.sin(angle), dtype=dtype)


def _rotate_half(x, sign):
    """cat([-x2, x1]) for sign=+1 (the forward map R), cat([x2, -x1]) for sign=-1 (its transpose)."""
    xp = get_array_module(x)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return xp.concatenate([-x2, x1] if sign > 0 else [x2, -x1], axis=-1)


# x [B, T, nh, Dh]
def rope_forward(x, cos, sin):
    return x * cos + _rotate_half(x, +1) * sin


def rope_backward(dy, cos, sin):
    return dy * cos + _rotate_half(dy * sin, -1)


# ---------------------------------------------------------------- causal attention with GQA
def _causal_mask(T, G, dtype, xp):
    """Additive mask [G*T, T]: row (g, t) may attend to t' <= t."""
    tri = np.triu(np.full((T, T), -np.inf), k=1)
    return xp.asarray(np.tile(tri, (G, 1)), dtype=dtype)


def _group_heads(x, B, T, Hkv, G, Dh):
    """[B, T, Hkv*G, Dh] -> [B, Hkv, G*T, Dh]: the G query heads of a kv head stacked along rows."""
    return x.reshape(B, T, Hkv, G, Dh).transpose(0, 2, 3, 1, 4).reshape(B, Hkv, G * T, Dh)


def _ungroup_heads(x, B, T, Hkv, G, Dh):
    return x.reshape(B, Hkv, G, T, Dh).transpose(0, 3, 1, 2, 4).reshape(B, T, Hkv * G * Dh)


# q [B, T, H, Dh], k, v [B, T, Hkv, Dh] -> o [B, T, H*Dh]
def attention_forward(q, k, v):
    xp = get_array_module(q)
    B, T, H, Dh = q.shape
    Hkv = k.shape[2]
    G = H // Hkv
    scale = 1.0 / np.sqrt(Dh)
    qg = _group_heads(q * q.dtype.type(scale), B, T, Hkv, G, Dh)  # [B, Hkv, G*T, Dh]
    kt = k.transpose(0, 2, 3, 1)  # [B, Hkv, Dh, T]
    vt = v.transpose(0, 2, 1, 3)  # [B, Hkv, T, Dh]
    probs = xp.matmul(qg, kt)  # [B, Hkv, G*T, T]
    if probs.dtype.itemsize < 4:  # softmax in fp32 under bf16 compute
        probs = probs.astype(np.float32)
    probs += _causal_mask(T, G, probs.dtype, xp)
    probs -= probs.max(axis=-1, keepdims=True)
    xp.exp(probs, out=probs)
    probs /= probs.sum(axis=-1, keepdims=True)
    probs = probs.astype(q.dtype, copy=False)
    og = xp.matmul(probs, vt)  # [B, Hkv, G*T, Dh]
    return _ungroup_heads(og, B, T, Hkv, G, Dh), (qg, kt, vt, probs)


def attention_backward(do, cache):
    """do [B, T, H*Dh] -> dq [B, T, H, Dh], dk, dv [B, T, Hkv, Dh]."""
    xp = get_array_module(do)
    qg, kt, vt, probs = cache
    B, Hkv, GT, Dh = qg.shape
    T = kt.shape[-1]
    G = GT // T
    dog = _group_heads(do.reshape(B, T, Hkv * G, Dh), B, T, Hkv, G, Dh)
    dv = xp.matmul(probs.transpose(0, 1, 3, 2), dog)  # [B, Hkv, T, Dh], summed over the G heads
    dprobs = xp.matmul(dog, vt.transpose(0, 1, 3, 2))  # [B, Hkv, G*T, T]
    dprobs -= (dprobs * probs).sum(axis=-1, keepdims=True)
    dprobs *= probs  # now d(scores)
    scale = do.dtype.type(1.0 / np.sqrt(Dh))
    dqg = xp.matmul(dprobs, kt.transpose(0, 1, 3, 2))
    dqg *= scale
    dk = xp.matmul(dprobs.transpose(0, 1, 3, 2), qg)  # qg already carries the scale
    dq = _ungroup_heads(dqg, B, T, Hkv, G, Dh).reshape(B, T, Hkv * G, Dh)
    return dq, dk.transpose(0, 2, 1, 3), dv.transpose(0, 2, 1, 3)
