"""The transformer block and the model's flat forward/backward, written once for every layout.

Tensor parallelism enters only through `tpx` (boostmpi/parallel/tensor_parallel/), which owns how
each linear group is split and communicated; with a group of one it is the single-device model.
Shapes: h [N, Cl] where N = B*T and Cl is the local residual width (C, or C/p under btp);
Hl, Hkvl are the local heads.
"""

from boostmpi.model import layers
from boostmpi.model.recompute import NO_TAPE


def block_forward(h, i, P, tpx, rope, shape, tape=NO_TAPE, recompute=False):
    """One decoder layer: h + attn(norm(h)), then + mlp(norm(.)). Returns (h_out, cache).

    `recompute=True`: a recompute whose cache the backward consumes at once. It never reads the
    layer's output, so the strategy may skip the last B product (local work only, never a
    collective), and the cache may hold what the backward would otherwise compute again (the
    sigmoids of the SiLUs, the attention probabilities): the same bits either way."""
    B, T = shape
    N = B * T
    Dh = tpx.C // tpx.cfg.model.n_heads
    pre = f"layers/{i}/"
    (q, k, v), c_qkv = tpx.in_proj_forward(h, pre + "attn_norm", [pre + "q", pre + "k", pre + "v"], P, tape,
                                           recompute=recompute)
    q = layers.rope_forward(q.reshape(B, T, tpx.n_heads, Dh), *rope)
    k = layers.rope_forward(k.reshape(B, T, tpx.n_kv_heads, Dh), *rope)
    stats = tape.take() if tape.replaying else None  # lowrank keeps the softmax statistics
    o, c_att = layers.attention_forward(q, k, v.reshape(B, T, tpx.n_kv_heads, Dh), keep_probs=recompute, stats=stats)
    tape.keep(c_att[4:6])
    y, c_o = tpx.out_proj_forward(o.reshape(N, -1), pre + "o", P, tape, recompute=recompute)
    h = h + y
    (g, u), c_gu = tpx.in_proj_forward(h, pre + "mlp_norm", [pre + "gate", pre + "up"], P, tape, recompute=recompute)
    act = tpx.cfg.model.mlp_gate_act
    a, s_gate = layers.gate_forward_for(g, u, act, recompute)
    y, c_down = tpx.out_proj_forward(a, pre + "down", P, tape, need_output=not recompute, recompute=recompute)
    return (h + y if y is not None else None), [c_qkv, c_att, c_o, c_gu, (g, u, act, s_gate), c_down]


def block_backward(dh, cache, P, Gr, tpx, rope):
    """Accumulates the layer's parameter gradients into Gr; returns d(input residual).

    `cache` (the list block_forward returned) is emptied, and each part is let go as soon as the
    backward has read it, so the layer's activations leave memory while its backward runs."""
    c_qkv, c_att, c_o, c_gu, (g, u, act, s_gate), c_down = cache
    cache.clear()
    da = tpx.out_proj_backward(dh, c_down, P, Gr)
    del c_down
    dg, du = layers.gate_backward(da, g, u, act, s_gate)
    del da, g, u, s_gate
    dh = dh + tpx.in_proj_backward([dg, du], c_gu, P, Gr)
    del dg, du, c_gu
    do = tpx.out_proj_backward(dh, c_o, P, Gr)
    del c_o
    B, T = c_att[1].shape[0], c_att[1].shape[2]
    dq, dk, dv = layers.attention_backward(do.reshape(B, T, -1), c_att)
    del do, c_att
    dq = layers.rope_backward(dq, *rope).reshape(B * T, -1)
    dk = layers.rope_backward(dk, *rope).reshape(B * T, -1)
    return dh + tpx.in_proj_backward([dq, dk, dv.reshape(B * T, -1)], c_qkv, P, Gr)
