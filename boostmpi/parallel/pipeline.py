"""The pipeline schedules, as data: per pipeline rank, a list of ("F"|"B", chunk, micro_batch) steps.

Plain 1F1B (one chunk per rank, `n_chunks = 1`): stage s of S first runs min(S - s - 1, M) forward
passes (warm-up), then alternates one forward and one backward (steady state), then drains the
remaining backward passes (cool-down). Every stage holds at most S - s micro-batches of
activations at once, instead of M under GPipe.

Interleaved 1F1B (`n_chunks = v > 1`, parallel.virtual_stages): the layers are cut into S * v
chunks and rank s runs chunks s, s + S, s + 2S, ... (its "virtual stages" c * S + s, c = 0..v-1),
so a micro-batch travels the ring of ranks v times. Every rank runs its forward units in the same
order: micro-batches in groups of S, each group through chunk 0, then chunk 1, ... (forward unit k
is micro-batch (k // (S v)) * S + k % S of chunk (k // S) % v); backward units in the same order with
the chunks reversed. This is why M must be a multiple of S: a group of S micro-batches leaves rank
S - 1 through chunk c exactly when rank 0 is ready to take it into chunk c + 1. Rank s warms up with
(v - 1) * S + 2 * (S - s - 1) forward units (all of them when fewer), then alternates one forward
and one backward unit, then drains. The warm-up and cool-down are made of chunks 1/v as long as a
stage's layers, which divides the bubble by v: (S - 1) / (v M) of the ideal compute time, against
(S - 1) / M for plain 1F1B. The data flow alone needs (v - 1) S + S - s - 1 warm-up units; the
further S - s - 1 keep the steady state fed while messages travel: with p2p latency the shorter
warm-up leaves a larger bubble (tests/unit/parallel/test_pipeline.py). The price is memory: rank 0 holds up to
(v + 1) S - 1 chunks' activations at once, 1 + (S - 1) / (S v) times what plain 1F1B keeps
there (docs/MEMORY.md).

Messages: the activation leaving virtual stage j goes to virtual stage j + 1 (rank (s + 1) mod S),
the gradient leaving j to j - 1 (rank (s - 1) mod S). `message_tag` numbers them so that every
message between two ranks has its own tag; with one chunk it is 2 * micro_batch (+1 for gradients).
"""

from __future__ import annotations

FORWARD, BACKWARD = 0, 1  # the kind bit of a message tag


def one_f_one_b(n_stages: int, stage: int, n_micro: int) -> list[tuple[str, int]]:
    """Plain 1F1B as [("F"|"B", micro_batch)]."""
    warmup = min(n_stages - stage - 1, n_micro)
    steps = [("F", mb) for mb in range(warmup)]
    for i in range(n_micro - warmup):
        steps.append(("F", warmup + i))
        steps.append(("B", i))
    steps.extend(("B", mb) for mb in range(n_micro - warmup, n_micro))
    return steps


def unit(n_stages: int, n_chunks: int, k: int, backward: bool = False) -> tuple[int, int]:
    """(chunk, micro_batch) of forward (or backward) unit k of the interleaved order."""
    group, within = divmod(k, n_stages * n_chunks)
    chunk = within // n_stages
    return (n_chunks - 1 - chunk if backward else chunk), group * n_stages + within % n_stages


def warmup_units(n_stages: int, stage: int, n_micro: int, n_chunks: int) -> int:
    """Forward units rank `stage` runs before its first backward."""
    if n_chunks == 1:
        return min(n_stages - stage - 1, n_micro)
    return min((n_chunks - 1) * n_stages + 2 * (n_stages - stage - 1), n_chunks * n_micro)


def schedule(n_stages: int, stage: int, n_micro: int, n_chunks: int = 1) -> list[tuple[str, int, int]]:
    """The steps of pipeline rank `stage`: [("F"|"B", chunk, micro_batch)] in the order it runs them."""
    if n_chunks == 1:
        return [(kind, 0, mb) for kind, mb in one_f_one_b(n_stages, stage, n_micro)]
    if n_micro % n_stages:
        raise ValueError(f"interleaved 1F1B needs micro-batches ({n_micro}) divisible by stages ({n_stages})")
    total = n_chunks * n_micro
    warmup = warmup_units(n_stages, stage, n_micro, n_chunks)
    steps = [("F", *unit(n_stages, n_chunks, k)) for k in range(warmup)]
    for i in range(total - warmup):
        steps.append(("F", *unit(n_stages, n_chunks, warmup + i)))
        steps.append(("B", *unit(n_stages, n_chunks, i, backward=True)))
    steps.extend(("B", *unit(n_stages, n_chunks, k, backward=True)) for k in range(total - warmup, total))
    return steps


def message_tag(kind: int, micro_batch: int, edge: int, n_stages: int, n_chunks: int) -> int:
    """The tag of the message across `edge` (between virtual stages edge and edge + 1) for `micro_batch`:
    FORWARD for the activation, BACKWARD for its gradient. Distinct for every message between two ranks."""
    return 2 * (micro_batch * n_chunks + edge // n_stages) + kind


class Step:
    """One step of a rank's schedule with its messages: `recv` and `send` are (peer, tag) or None."""

    __slots__ = ("kind", "chunk", "mb", "recv", "send")

    def __init__(self, kind: str, chunk: int, mb: int, recv: tuple[int, int] | None, send: tuple[int, int] | None,
                 ) -> None:
        self.kind, self.chunk, self.mb, self.recv, self.send = kind, chunk, mb, recv, send

    def __repr__(self) -> str:
        return f"Step({self.kind}, chunk={self.chunk}, mb={self.mb}, recv={self.recv}, send={self.send})"


def steps_with_messages(n_stages: int, stage: int, n_micro: int, n_chunks: int = 1) -> list[Step]:
    """`schedule` with each step's receive (before it) and send (after it)."""
    last = n_stages * n_chunks - 1
    up, down = (stage + 1) % n_stages, (stage - 1) % n_stages
    out = []
    for kind, chunk, mb in schedule(n_stages, stage, n_micro, n_chunks):
        j = chunk * n_stages + stage  # this step's virtual stage
        if kind == "F":
            recv = (down, message_tag(FORWARD, mb, j - 1, n_stages, n_chunks)) if j > 0 else None
            send = (up, message_tag(FORWARD, mb, j, n_stages, n_chunks)) if j < last else None
        else:
            recv = (up, message_tag(BACKWARD, mb, j, n_stages, n_chunks)) if j < last else None
            send = (down, message_tag(BACKWARD, mb, j - 1, n_stages, n_chunks)) if j > 0 else None
        out.append(Step(kind, chunk, mb, recv, send))
    return out
