"""Tensor parallelism: how each linear group, the embedding and the head are split and communicated.

Region mappings, Megatron's vocabulary, each with both directions:
  copy to tp region      forward: identity     backward: all-reduce   (input of a column-parallel factor)
  reduce from tp region  forward: all-reduce   backward: identity     (output of a row-parallel factor)
  gather from tp region  forward: all-gather   backward: split        (btp: residual shards -> head)

Three strategies share one interface, so the transformer block (boostmpi/model/transformer.py)
is written once:
  BottleneckTP ('btp')   residual [N, C/p]; A row-parallel -> all-reduce of the rank-R activation
                         (online RMSNorm's statistic rides along) -> B column-parallel.
  VanillaLowRankTP       Megatron applied to each factor: A column-parallel along R, B row-parallel
                         along R, all-reduce of the full output after every B; residual replicated.
  MegatronTP             full rank: q/k/v/gate/up column-parallel, o/down row-parallel.
With a tensor-parallel group of one, every strategy is the plain single-device model.

Interface:
  in_proj_forward(x, norm_w, names, P, tape, recompute) -> (outs, cache)   norm + the linears reading it
  in_proj_backward(douts, cache, P, Gr) -> dx
  out_proj_forward(x, name, P, tape, need_output, recompute) -> (y, cache) o and down, into the residual
  out_proj_backward(dy, cache, P, Gr) -> dx
  embed_forward / embed_backward, head_forward / head_backward
`P` and `Gr` are the parameter and gradient views of this rank; `tape` records the
post-communication rank-R activations so that recompute = "lowrank" replays them instead of
communicating again (see `Tape`). `recompute=True` marks a forward whose cache the backward
consumes at once: the cache then also holds the SiLU's sigmoid (NumPy path), which the backward
would otherwise compute again.
"""

import numpy as np

from boostmpi.model import layers
from boostmpi.model.params import split_range, tp_strategy
from boostmpi.backend import get_array_module


class Tape:
    """What recompute = "lowrank" keeps of one layer: the results of its collectives, and the
    attention's two softmax statistics per head and token, in the order the forward made them.

    mode "record": the forward appends what each bottleneck collective produced (and
    block_forward the attention statistics).
    mode "replay": the recompute forward takes them back in order instead of recomputing the A
    GEMM and issuing the all-reduce (and instead of reducing the attention scores again).
    mode None: neither.
    """

    def __init__(self, mode=None, items=None):
        self.mode = mode
        self.items = [] if items is None else items
        self._next = 0

    def record(self, item):
        if self.mode == "record":
            self.items.append(item)
        return item

    def replay(self):
        item = self.items[self._next]
        self._next += 1
        return item

    @property
    def replaying(self):
        return self.mode == "replay"

    def nbytes(self):
        return sum(a.nbytes for item in self.items for a in item if a is not None)


NO_TAPE = Tape()


def _concat_cols(mats):
    xp = get_array_module(mats[0])
    return mats[0] if len(mats) == 1 else xp.concatenate(mats, axis=1)


def grouped_matmul(lefts, rights, batched=True):
    """[l @ r for l, r in pairs]; with `batched`, pairs of equal shapes run as one batched GEMM
    (the grouped B factors: gate/up, and k/v, whose shapes agree) on a GPU. NumPy's batched matmul
    is a loop of the same BLAS calls, so on the CPU stacking the operands would only add copies."""
    xp = get_array_module(lefts[0])
    if xp is np:
        return [l @ r for l, r in zip(lefts, rights)]
    outs = [None] * len(lefts)
    by_shape = {}
    for j, (l, r) in enumerate(zip(lefts, rights)):
        by_shape.setdefault((l.shape, r.shape) if batched else j, []).append(j)
    for idx in by_shape.values():
        if len(idx) == 1:
            outs[idx[0]] = lefts[idx[0]] @ rights[idx[0]]
            continue
        stacked = xp.matmul(xp.stack([lefts[j] for j in idx]), xp.stack([rights[j] for j in idx]))
        for k, j in enumerate(idx):
            outs[j] = stacked[k]
    return outs


def _col_slices(widths):
    out, start = [], 0
    for w in widths:
        out.append(slice(start, start + w))
        start += w
    return out


class _Strategy:
    def __init__(self, cfg, grid, tp_rank=None):
        m = cfg.model
        self.cfg = cfg
        self.tp = grid.tp
        self.p = grid.tp.size
        self.t = grid.tp.rank if tp_rank is None else tp_rank
        self.C = m.d_model
        self.eps = m.norm_eps
        self.arch = m.arch
        self.act = m.arch == "cola"
        self.grouped = cfg.parallel.grouped
        self.V = m.vocab_size
        self.v0, self.v1 = split_range(self.V, self.p, self.t)
        # subclasses set: local residual width, local heads
        self.res_cols = (0, self.C)
        self.n_heads = m.n_heads
        self.n_kv_heads = m.n_kv_heads

    # ------------------------------------------------------------ head: final norm, vocab-parallel logits, CE
    def _gather_residual(self, h):
        return h

    def _split_residual_grad(self, dh):
        return dh

    def head_forward(self, h, targets, P, lean=False):
        """h [N, C_local], targets [N] -> (loss: mean CE over N, cache). Sharded cross-entropy.

        `lean` (recompute = lowrank): keep only what came out of collectives (the gathered residual
        and the softmax statistics) and recompute the logits locally in backward."""
        xp = get_array_module(h)
        hf = self._gather_residual(h)
        n, rstd = layers.rmsnorm_forward(hf, P["final_norm"], self.eps)
        logits = self._logits(n, P)
        mx = logits.max(axis=-1)
        self.tp.allreduce(mx, op="max")
        probs = xp.exp(logits - mx[:, None])
        local = (targets >= self.v0) & (targets < self.v1)
        tidx = xp.where(local, targets - self.v0, 0)
        rows = xp.arange(len(targets))
        stats = xp.stack([probs.sum(axis=-1), xp.where(local, logits[rows, tidx], 0)], axis=1)
        self.tp.allreduce(stats)
        sumexp, target_logit = stats[:, 0], stats[:, 1]
        losses = xp.log(sumexp) + mx - target_logit
        if lean:
            return float(losses.mean()), (hf, None, rstd, (mx, sumexp), local, tidx)
        probs /= sumexp[:, None]
        return float(losses.mean()), (hf, n, rstd, probs, local, tidx)

    def _logits(self, n, P):
        logits = n @ P["lm_head"]  # [N, V_local]
        return logits.astype(np.promote_types(logits.dtype, np.float32), copy=False)  # softmax and loss in >= fp32

    def head_backward(self, cache, scale, P, Gr):
        """d(loss)/d(h) for loss = scale * sum of per-token CE; returns dh [N, C_local]."""
        hf, n, rstd, probs, local, tidx = cache
        xp = get_array_module(hf)
        if n is None:  # lean cache: recompute locally from the saved post-collective values
            mx, sumexp = probs
            n = hf * rstd * P["final_norm"]
            probs = xp.exp(self._logits(n, P) - mx[:, None])
            probs /= sumexp[:, None]
        dlogits = probs
        rows = xp.arange(len(tidx))
        dlogits[rows[local], tidx[local]] -= 1.0
        dlogits *= scale
        dn = dlogits.astype(n.dtype, copy=False) @ P["lm_head"].T  # partial over the vocabulary shards
        req = self.tp.iallreduce(dn)  # copy-to-region backward of the lm_head input
        Gr["lm_head"] += n.T @ dlogits
        req.wait()
        dh = layers.rmsnorm_backward(dn, hf, P["final_norm"], rstd, Gr["final_norm"])
        return self._split_residual_grad(dh.astype(hf.dtype, copy=False))


class BottleneckTP(_Strategy):
    """Bottleneck-aware TP: the residual stays sharded along C; communication only at rank R."""

    def __init__(self, cfg, grid, tp_rank=None):
        super().__init__(cfg, grid, tp_rank)
        m = cfg.model
        self.res_cols = split_range(self.C, self.p, self.t)
        self.n_heads = m.n_heads // self.p
        self.n_kv_heads = m.n_kv_heads // self.p
        self.online = cfg.parallel.norm == "online"

    # -- embedding sharded along C: no communication either way
    embedding_is_local = True

    def embed_forward(self, ids, P):
        return layers.embedding_forward(P["embed"], ids)

    def embed_backward(self, ids, dh, Gr):
        layers.embedding_backward(Gr["embed"], ids, dh)

    # -- gather from tp region (forward: all-gather, backward: split)
    def _gather_residual(self, h):
        if self.p == 1:
            return h
        xp = get_array_module(h)
        parts = self.tp.allgather(h)  # [p, N, C/p]
        return xp.ascontiguousarray(parts.transpose(1, 0, 2).reshape(h.shape[0], -1))

    def _split_residual_grad(self, dh):
        a, b = self.res_cols
        return xp_contig(dh[:, a:b]) if self.p > 1 else dh

    # -- a low-rank group: [norm] -> A row-parallel -> all-reduce(rank R [+ statistic]) -> act -> B column-parallel
    def in_proj_forward(self, x, norm_name, names, P, tape=NO_TAPE, recompute=False):
        return self._bottleneck_forward(x, norm_name, names, P, tape, recompute=recompute)

    def in_proj_backward(self, douts, cache, P, Gr):
        return self._bottleneck_backward(douts, cache, P, Gr)

    def out_proj_forward(self, x, name, P, tape=NO_TAPE, need_output=True, recompute=False):
        """`need_output=False` (a recompute whose result the backward never reads) skips the B GEMM."""
        outs, cache = self._bottleneck_forward(x, None, [name], P, tape, need_output, recompute)
        return outs[0], cache

    def out_proj_backward(self, dy, cache, P, Gr):
        return self._bottleneck_backward([dy], cache, P, Gr)

    def _bottleneck_forward(self, x, norm_name, names, P, tape, need_output=True, recompute=False):
        As = [P[f"{nm}/A"] for nm in names]
        xw = x * P[norm_name] if norm_name else x
        if tape.replaying:
            Z, rstd = tape.replay()
        else:
            Z, rstd = self._reduce_bottleneck(x, xw, As, norm_name is not None)
            tape.record((Z, rstd))
        Zs, sig = _activate(Z, self.act, recompute)
        sl = _col_slices([A.shape[1] for A in As])
        if need_output:
            outs = grouped_matmul([Zs[:, s] for s in sl], [P[f"{nm}/B"] for nm in names], self.grouped)
        else:
            outs = [None] * len(names)
        return outs, (x, xw, norm_name, Z, Zs, rstd, names, sl, sig)

    def _reduce_bottleneck(self, x, xw, As, with_norm):
        """The only forward communication of a btp layer: Z = rmsnorm(x)·A exactly, from shards."""
        xp = get_array_module(x)
        R = sum(A.shape[1] for A in As)
        if not with_norm:
            return self._allreduce_products(xw, As, extra=None), None
        ss = (x * x).sum(axis=-1)
        if self.online:
            # the sum of squares rides in the same all-reduce as the unnormalised A-product
            buf = self._allreduce_products(xw, As, extra=ss)
            rstd = (1.0 / xp.sqrt(buf[:, R] / self.C + self.eps))[:, None]
            return buf[:, :R] * rstd, rstd
        # sync: a separate all-reduce of the statistic first, then normalise and multiply
        self.tp.allreduce(ss)
        rstd = (1.0 / xp.sqrt(ss / self.C + self.eps))[:, None]
        return self._allreduce_products(xw * rstd, As, extra=None), rstd

    def _allreduce_products(self, x, As, extra):
        """[x·A_1 | x·A_2 | ... | extra] summed over the tp group: one GEMM and one all-reduce when
        grouped, else one of each per factor (the statistic riding with the first)."""
        xp = get_array_module(x)
        N = x.shape[0]
        R = sum(A.shape[1] for A in As)
        buf = xp.empty((N, R + (extra is not None)), dtype=x.dtype)
        if extra is not None:
            buf[:, R] = extra
        if self.grouped:
            xp.matmul(x, _concat_cols(As), out=buf[:, :R])
            return self.tp.allreduce(buf)
        sl = _col_slices([A.shape[1] for A in As])
        for j, (s, A) in enumerate(zip(sl, As)):
            piece = x @ A
            if j == 0 and extra is not None:
                piece = self.tp.allreduce(xp.concatenate([piece, extra[:, None]], axis=1))
                buf[:, s], buf[:, R] = piece[:, :-1], piece[:, -1]
            else:
                buf[:, s] = self.tp.allreduce(xp.ascontiguousarray(piece))
        return buf

    def _bottleneck_backward(self, douts, cache, P, Gr):
        x, xw, norm_name, Z, Zs, rstd, names, sl, sig = cache
        xp = get_array_module(x)
        dZs = xp.empty_like(Z)
        Bs = [P[f"{nm}/B"] for nm in names]
        for s, d in zip(sl, grouped_matmul(douts, [B.T for B in Bs], self.grouped)):
            dZs[:, s] = d
        # copy-to-region backward: sum the partial dZ of every rank, started before dB's GEMMs
        with _Pending(self.tp, dZs, sl, self.grouped):
            for nm, dB in zip(names, grouped_matmul([Zs[:, s].T for s in sl], douts, self.grouped)):
                Gr[f"{nm}/B"] += dB
        dZ = layers.silu_backward(dZs, Z, sig) if self.act else dZs
        As = [P[f"{nm}/A"] for nm in names]
        if norm_name is None:
            dx = dZ @ _concat_cols(As).T
            for s, nm in zip(sl, names):
                Gr[f"{nm}/A"] += xw.T @ dZ[:, s]
            return dx
        # exact backward of Z = (sum_i xw_i·A_i) * rstd(S), S = sum of squares over all shards;
        # dZ and Z are replicated over the tp group, so the statistic's gradient dS is local
        dP = dZ * rstd
        dS = (-0.5 / self.C) * (dZ * Z).sum(axis=-1, keepdims=True) * (rstd * rstd)
        dxw = dP @ _concat_cols(As).T
        for s, nm in zip(sl, names):
            Gr[f"{nm}/A"] += xw.T @ dP[:, s]
        Gr[norm_name] += (dxw * x).sum(axis=0)
        return dxw * P[norm_name] + 2.0 * x * dS


def _activate(Z, act, recompute):
    """(silu(Z), its sigmoid when a recompute keeps it for the backward, else None); (Z, None) without act."""
    return layers.silu_forward_for(Z, recompute) if act else (Z, None)


class _Pending:
    """Context: all-reduce `buf` (or its column slices, ungrouped) in the background during the block."""

    def __init__(self, group, buf, slices, grouped):
        self.group, self.buf, self.slices, self.grouped = group, buf, slices, grouped

    def __enter__(self):
        xp = get_array_module(self.buf)
        if self.grouped or len(self.slices) == 1:
            self.pieces = None
            self.reqs = [self.group.iallreduce(self.buf)]
        else:
            self.pieces = [xp.ascontiguousarray(self.buf[:, s]) for s in self.slices]
            self.reqs = [self.group.iallreduce(piece) for piece in self.pieces]
        return self

    def __exit__(self, *exc):
        for r in self.reqs:
            r.wait()
        if self.pieces is not None:
            for s, piece in zip(self.slices, self.pieces):
                self.buf[:, s] = piece
        return False


def xp_contig(a):
    return get_array_module(a).ascontiguousarray(a)


class _ReplicatedResidual(_Strategy):
    """Shared by the Megatron-style strategies: residual and norms replicated, vocabulary-parallel embedding."""

    # -- vocabulary-parallel embedding: forward reduce-from-region (all-reduce), backward identity
    @property
    def embedding_is_local(self):
        return self.p == 1

    def _local_ids(self, ids):
        xp = get_array_module(ids)
        mask = (ids >= self.v0) & (ids < self.v1)
        return xp.where(mask, ids - self.v0, 0), mask

    def embed_forward(self, ids, P):
        local, mask = self._local_ids(ids)
        h = layers.embedding_forward(P["embed"], local)
        if self.p > 1:
            h *= mask[:, None]
            self.tp.allreduce(h)
        return h

    def embed_backward(self, ids, dh, Gr):
        local, mask = self._local_ids(ids)
        layers.embedding_backward(Gr["embed"], local[mask], dh[mask])

    def _norm_forward(self, x, norm_name, P):
        n, rstd = layers.rmsnorm_forward(x, P[norm_name], self.eps)
        return n, rstd

    def _input_grad(self, douts_or_dz, mats, grouped):
        """d(input) = sum_j d_j · M_j^T, all-reduced over tp (copy-to-region backward): one GEMM and
        one all-reduce when grouped, else one of each per factor."""
        xp = get_array_module(douts_or_dz[0])
        if grouped:
            d = xp.ascontiguousarray(_concat_cols(douts_or_dz) @ _concat_cols(mats).T)
            return d, [self.tp.iallreduce(d)], None
        parts = [xp.ascontiguousarray(dz @ M.T) for dz, M in zip(douts_or_dz, mats)]
        return None, [self.tp.iallreduce(part) for part in parts], parts


class VanillaLowRankTP(_ReplicatedResidual):
    """Megatron TP applied to each factor: A column-parallel along R, B row-parallel along R."""

    def in_proj_forward(self, x, norm_name, names, P, tape=NO_TAPE, recompute=False):
        n, rstd = self._norm_forward(x, norm_name, P)
        outs, cache = self._factor_forward(n, names, P, tape, recompute)
        return outs, (x, norm_name, rstd, cache)

    def in_proj_backward(self, douts, cache, P, Gr):
        x, norm_name, rstd, inner = cache
        dn = self._factor_backward(douts, inner, P, Gr)
        return layers.rmsnorm_backward(dn, x, P[norm_name], rstd, Gr[norm_name])

    def out_proj_forward(self, x, name, P, tape=NO_TAPE, need_output=True, recompute=False):
        # the output is produced regardless: its all-reduce is part of the forward's collectives
        outs, cache = self._factor_forward(x, [name], P, tape, recompute)
        return outs[0], cache

    def out_proj_backward(self, dy, cache, P, Gr):
        return self._factor_backward([dy], cache, P, Gr)

    def _factor_forward(self, x, names, P, tape, recompute=False):
        xp = get_array_module(x)
        As = [P[f"{nm}/A"] for nm in names]
        sl = _col_slices([A.shape[1] for A in As])
        if tape.replaying:
            (Z,) = tape.replay()
        elif self.grouped:
            Z = tape.record((x @ _concat_cols(As),))[0]
        else:
            Z = tape.record((xp.concatenate([x @ A for A in As], axis=1),))[0]
        Zs, sig = _activate(Z, self.act, recompute)
        # reduce from tp region after every B: the full [N, d_out] output
        ys = [xp.ascontiguousarray(Zs[:, s] @ P[f"{nm}/B"]) for s, nm in zip(sl, names)]
        if self.grouped and len(ys) > 1 and self.p > 1:
            widths = [y.shape[1] for y in ys]
            buf = self.tp.allreduce(xp.concatenate(ys, axis=1))
            ys = [buf[:, s] for s in _col_slices(widths)]
        else:
            ys = [self.tp.allreduce(y) for y in ys]
        return ys, (x, Z, Zs, names, sl, sig)

    def _factor_backward(self, douts, cache, P, Gr):
        x, Z, Zs, names, sl, sig = cache
        xp = get_array_module(x)
        dZs = xp.empty_like(Z)
        for s, nm, dy in zip(sl, names, douts):
            dZs[:, s] = dy @ P[f"{nm}/B"].T
            Gr[f"{nm}/B"] += Zs[:, s].T @ dy
        dZ = layers.silu_backward(dZs, Z, sig) if self.act else dZs
        As = [P[f"{nm}/A"] for nm in names]
        dx, reqs, parts = self._input_grad([dZ[:, s] for s in sl], As, self.grouped)
        for s, nm in zip(sl, names):  # weight gradients while the input gradient travels
            Gr[f"{nm}/A"] += x.T @ dZ[:, s]
        for r in reqs:
            r.wait()
        return dx if parts is None else sum(parts[1:], parts[0])


class MegatronTP(_ReplicatedResidual):
    """Full rank: q/k/v/gate/up column-parallel (heads and d_ff sharded), o/down row-parallel."""

    def __init__(self, cfg, grid, tp_rank=None):
        super().__init__(cfg, grid, tp_rank)
        self.n_heads = cfg.model.n_heads // self.p
        self.n_kv_heads = cfg.model.n_kv_heads // self.p

    def in_proj_forward(self, x, norm_name, names, P, tape=NO_TAPE, recompute=False):
        n, rstd = self._norm_forward(x, norm_name, P)
        Ws = [P[f"{nm}/W"] for nm in names]
        if self.grouped:
            y = n @ _concat_cols(Ws)
            outs = [y[:, s] for s in _col_slices([W.shape[1] for W in Ws])]
        else:
            outs = [n @ W for W in Ws]
        return outs, (x, n, norm_name, rstd, names)

    def in_proj_backward(self, douts, cache, P, Gr):
        x, n, norm_name, rstd, names = cache
        Ws = [P[f"{nm}/W"] for nm in names]
        dn, reqs, parts = self._input_grad(douts, Ws, self.grouped)
        for nm, dy in zip(names, douts):
            Gr[f"{nm}/W"] += n.T @ dy
        for r in reqs:
            r.wait()
        dn = dn if parts is None else sum(parts[1:], parts[0])
        return layers.rmsnorm_backward(dn, x, P[norm_name], rstd, Gr[norm_name])

    def out_proj_forward(self, x, name, P, tape=NO_TAPE, need_output=True, recompute=False):
        y = get_array_module(x).ascontiguousarray(x @ P[f"{name}/W"])
        return self.tp.allreduce(y), (x, name)  # reduce from tp region

    def out_proj_backward(self, dy, cache, P, Gr):
        x, name = cache
        Gr[f"{name}/W"] += x.T @ dy
        return dy @ P[f"{name}/W"].T


STRATEGIES = {"btp": BottleneckTP, "vanilla": VanillaLowRankTP, "megatron": MegatronTP}


def make_strategy(cfg, grid):
    return STRATEGIES[tp_strategy(cfg)](cfg, grid)
