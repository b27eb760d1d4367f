"""AdamW over flat buffers, the learning-rate schedule and global-norm clipping.

Weight decay (decoupled, scaled by the learning rate as in Loshchilov & Hutter) applies to every
matrix: embedding, LM head, W, A and B. Norm weights are not decayed.
"""

import math

import numpy as np

from boostmpi.model.params import FlatBuffer


def learning_rate(step, tr):
    """Linear warm-up to `lr` over `warmup_steps`, then cosine decay to `lr * min_lr_ratio` at the last step."""
    if step < tr.warmup_steps:
        return tr.lr * (step + 1) / tr.warmup_steps
    span = max(1, tr.steps - 1 - tr.warmup_steps)
    progress = min(1.0, (step - tr.warmup_steps) / span)
    floor = tr.lr * tr.min_lr_ratio
    return floor + 0.5 * (tr.lr - floor) * (1.0 + math.cos(math.pi * progress))


def clip_coefficient(grad_norm, max_norm):
    if max_norm <= 0 or not math.isfinite(grad_norm) or grad_norm <= max_norm:
        return 1.0
    return max_norm / (grad_norm + 1e-6)


class AdamW:
    """One update over the whole flat parameter buffer per step (four vector operations, no loop over tensors)."""

    def __init__(self, params, specs, tr, xp=np):
        self.params, self.tr, self.xp = params, tr, xp
        self.m = FlatBuffer(specs, params.data.dtype, xp)
        self.v = FlatBuffer(specs, params.data.dtype, xp)
        mask = np.zeros(params.size, dtype=params.data.dtype)
        for s in specs:
            if s.decay:
                a, b = params.spans[s.name]  # a grouped block holds only decayed matrices
                mask[a:b] = 1.0
        self.decay_mask = xp.asarray(mask)
        self.t = 0  # updates taken (for bias correction)
        self._scratch = xp.empty_like(params.data)

    def step(self, grads, lr, grad_scale=1.0):
        xp, tr = self.xp, self.tr
        self.t += 1
        p, m, v, g = self.params.data, self.m.data, self.v.data, grads.data
        if grad_scale != 1.0:
            g = g * g.dtype.type(grad_scale)
        b1, b2 = tr.beta1, tr.beta2
        m *= b1
        m += (1.0 - b1) * g
        v *= b2
        tmp = self._scratch
        xp.multiply(g, g, out=tmp)
        tmp *= 1.0 - b2
        v += tmp
        bc1 = 1.0 - b1 ** self.t
        bc2 = 1.0 - b2 ** self.t
        # p -= lr * (m_hat / (sqrt(v_hat) + eps) + wd * p)   (decoupled decay, matrices only)
        if tr.weight_decay:
            p -= (lr * tr.weight_decay) * self.decay_mask * p
        xp.sqrt(v, out=tmp)
        tmp /= math.sqrt(bc2)
        tmp += tr.adam_eps
        xp.divide(m, tmp, out=tmp)
        tmp *= lr / bc1
        p -= tmp
