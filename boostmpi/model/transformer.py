"""The transformer block and the model's flat forward/backward, written once for every layout.

Tensor parallelism enters only through `tpx` (boostmpi/parallel/tensor_parallel.py), which owns how
each linear group is split and communicated; with a group of one it is the single-device model.
Shapes: h [N, Cl] where N = B*T and Cl is the local residual width (C, or C/p under btp);
Hl, Hkvl are the local heads.
"""

from boostmpi.model import layers
from boostmpi.parallel.tensor_parallel import NO_TAPE


def block_forward(h, i, P, tpx, rope, shape, tape=NO_TAPE, need_output=True):
    """One decoder layer: h + attn(norm(h)), then + mlp(norm(.)). Returns (h_out, cache).

    `need_output=False`: a recompute for backward, which never reads the layer's output; the
    strategy may then skip the last B product (local work only, never a collective)."""
    B, T = shape
    N = B * T
    Dh = tpx.C // tpx.cfg.model.n_heads
    pre = f"layers/{i}/"
    (q, k, v), c_qkv = tpx.in_proj_forward(h, pre + "attn_norm", [pre + "q", pre + "k", pre + "v"], P, tape)
    q = layers.rope_forward(q.reshape(B, T, tpx.n_heads, Dh), *rope)
    k = layers.rope_forward(k.reshape(B, T, tpx.n_kv_heads, Dh), *rope)
    o, c_att = layers.attention_forward(q, k, v.reshape(B, T, tpx.n_kv_heads, Dh))
    y, c_o = tpx.out_proj_forward(o.reshape(N, -1), pre + "o", P, tape)
    h = h + y
    (g, u), c_gu = tpx.in_proj_forward(h, pre + "mlp_norm", [pre + "gate", pre + "up"], P, tape)
    act = tpx.cfg.model.mlp_gate_act
    a = layers.gate_forward(g, u, act)
    y, c_down = tpx.out_proj_forward(a, pre + "down", P, tape, need_output=need_output)
    return (h + y if y is not None else None), (c_qkv, c_att, c_o, c_gu, (g, u, act), c_down)


def block_backward(dh, cache, P, Gr, tpx, rope):
    """Accumulates the layer's parameter gradients into Gr; returns d(input residual)."""
    c_qkv, c_att, c_o, c_gu, (g, u, act), c_down = cache
    da = tpx.out_proj_backward(dh, c_down, P, Gr)
    dg, du = layers.gate_backward(da, g, u, act)
    dh = dh + tpx.in_proj_backward([dg, du], c_gu, P, Gr)
    do = tpx.out_proj_backward(dh, c_o, P, Gr)
    B, T = c_att[1].shape[0], c_att[1].shape[2]
    dq, dk, dv = layers.attention_backward(do.reshape(B, T, -1), c_att)
    dq = layers.rope_backward(dq, *rope).reshape(B * T, -1)
    dk = layers.rope_backward(dk, *rope).reshape(B * T, -1)
    return dh + tpx.in_proj_backward([dq, dk, dv.reshape(B * T, -1)], c_qkv, P, Gr)
