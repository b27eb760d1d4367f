"""NumPy twins of the CUDA kernels in `kernels/*.cu`: the CPU-side specification of each.

One function per kernel wrapper in `boostmpi.gpu.kernels`, same arguments, same outputs.
Arithmetic happens in the accumulation dtype -- float32 for float32 and bfloat16 inputs (as
in the kernels), float64 for float64 inputs (for gradient checks) -- and the big outputs are
rounded back to the input dtype once, at the end, as the kernels store them. Statistics
(`rstd`, `ss`, `loss`, `dw`) stay in the accumulation dtype.

Shapes: N rows, C channels (Cs a tensor-parallel shard of them), R rank, V vocabulary.
"""

import numpy as np


def accumulation_dtype(dtype):
    return np.float64 if np.dtype(dtype) == np.float64 else np.float32


def _widen(*arrays):
    """The arrays in their accumulation dtype (taken from the first)."""
    acc = accumulation_dtype(arrays[0].dtype)
    return [np.asarray(a, dtype=acc) for a in arrays]


# ------------------------------------------------------------------------------ rmsnorm.cu


def rmsnorm_forward(x, w, eps):
    """x [N,C], w [C] -> y [N,C], rstd [N]; rstd = 1/sqrt(mean(x^2) + eps), y = x * rstd * w."""
    xf, wf = _widen(x, w)
    rstd = 1.0 / np.sqrt(np.mean(xf * xf, axis=1) + eps)
    y = xf * rstd[:, None] * wf
    return y.astype(x.dtype), rstd


def rmsnorm_backward(dy, x, w, rstd):
    """dy, x [N,C], w [C], rstd [N] -> dx [N,C], dw [C] (accumulation dtype).

    dx = rstd * (dy * w) - x * rstd^3 * mean(dy * w * x), per row; dw = sum over rows of
    dy * x * rstd. (The kernel writes per-block partial sums of dw; its wrapper sums them.)
    """
    dyf, xf, wf, rstdf = _widen(dy, x, w, rstd)
    r = rstdf[:, None]
    mean_dot = np.mean(dyf * wf * xf, axis=1, keepdims=True)
    dx = r * (dyf * wf) - xf * (r * r * r * mean_dot)
    dw = np.sum(dyf * xf * r, axis=0)
    return dx.astype(x.dtype), dw


def rmsnorm_online_stats(x, w):
    """This rank's shard x [N,Cs], w [Cs] -> xw [N,Cs] = x * w, ss [N] = sum(x^2).

    With ss summed over all shards (ss_total) and P = sum over shards of xw_s @ A_s,
    rescale_rows(P, ss_total, C, eps) == rmsnorm(x, w) @ A.
    """
    xf, wf = _widen(x, w)
    return (xf * wf).astype(x.dtype), np.sum(xf * xf, axis=1)


def rescale_rows(P, ss_total, C_total, eps):
    """P [N,R], ss_total [N] -> P * rsqrt(ss_total / C_total + eps) [N,R]."""
    pf, ssf = _widen(P, ss_total)
    rstd = 1.0 / np.sqrt(ssf / C_total + eps)
    return (pf * rstd[:, None]).astype(P.dtype)


# ------------------------------------------------------------------------------ lowrank.cu


def _sigmoid(a):
    return 1.0 / (1.0 + np.exp(-a))


def silu_forward(a):
    """z = silu(a) = a * sigmoid(a), elementwise."""
    (af,) = _widen(a)
    return (af * _sigmoid(af)).astype(a.dtype)


def silu_backward(a, dz):
    """da = dz * silu'(a), silu'(a) = s * (1 + a * (1 - s)), s = sigmoid(a)."""
    af, dzf = _widen(a, dz)
    s = _sigmoid(af)
    return (dzf * (s * (1.0 + af * (1.0 - s)))).astype(a.dtype)


def gate_forward(g, u, act):
    """y = act(g) * u; act = silu when `act` is true, identity otherwise."""
    gf, uf = _widen(g, u)
    activated = gf * _sigmoid(gf) if act else gf
    return (activated * uf).astype(g.dtype)


def gate_backward(g, u, dy, act):
    """dg = dy * u * act'(g), du = dy * act(g)."""
    gf, uf, dyf = _widen(g, u, dy)
    if act:
        s = _sigmoid(gf)
        du = dyf * (gf * s)
        dg = dyf * uf * (s * (1.0 + gf * (1.0 - s)))
    else:
        du = dyf * gf
        dg = dyf * uf
    return dg.astype(g.dtype), du.astype(g.dtype)


# ------------------------------------------------------------------------------ softmax_xent.cu


def softmax_xent(logits, targets, grad_scale=None, out=None):
    """logits [N,V], targets [N] -> loss [N], dlogits [N,V] or None.

    loss = logsumexp(row) - row[target] (max-subtracted); with grad_scale,
    dlogits = (softmax(row) - onehot(target)) * grad_scale, written to `out` when given (it may
    be `logits` itself). A target outside [0, V) gives a NaN loss and a gradient without the
    one-hot term.
    """
    (lf,) = _widen(logits)
    N, V = lf.shape
    targets = np.asarray(targets)
    valid = (targets >= 0) & (targets < V)
    rows = np.arange(N)
    safe_targets = np.where(valid, targets, 0)

    row_max = np.max(lf, axis=1, keepdims=True)
    logsumexp = row_max + np.log(np.sum(np.exp(lf - row_max), axis=1, keepdims=True))
    loss = np.where(valid, logsumexp[:, 0] - lf[rows, safe_targets], np.nan).astype(lf.dtype)
    if grad_scale is None:
        return loss, None
    dlogits = np.exp(lf - logsumexp)
    dlogits[rows[valid], safe_targets[valid]] -= 1.0
    dlogits *= grad_scale
    if out is None:
        return loss, dlogits.astype(logits.dtype)
    out[...] = dlogits
    return loss, out
