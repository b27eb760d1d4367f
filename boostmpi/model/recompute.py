"""Recompute: what a layer's forward keeps so that its backward can run it again.

`Tape` is what recompute = "lowrank" keeps of one layer: what each of its collectives produced
(the post-all-reduce rank-R activations, with the RMSNorm statistic that rode along) and the
attention's two softmax statistics, in the order the forward made them. A recording forward
appends them; the replaying forward (the recompute, just before the layer's backward) takes them
back in the same order instead of computing the A GEMMs and communicating again, and instead of
reducing the attention scores again.
"""


class Tape:
    def __init__(self):
        self.items = []  # tuples of arrays (None for an absent statistic), in forward order
        self.mode = None  # None, "record" or "replay"
        self._next = 0

    def start_recording(self):
        self.mode, self.items, self._next = "record", [], 0
        return self

    def start_replaying(self):
        self.mode, self._next = "replay", 0
        return self

    @property
    def replaying(self):
        return self.mode == "replay"

    def keep(self, item):
        """Record `item` when recording; returns it either way."""
        if self.mode == "record":
            self.items.append(item)
        return item

    def take(self):
        """The next recorded item (replaying)."""
        item = self.items[self._next]
        self._next += 1
        return item

    def nbytes(self):
        return sum(a.nbytes for item in self.items for a in item if a is not None)


NO_TAPE = Tape()  # a forward that neither records nor replays
