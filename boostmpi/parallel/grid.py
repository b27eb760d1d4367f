"""The process grid: world ranks as (dp, pp, tp) coordinates, tp varying fastest.

world_rank = (dp_rank * pp + pp_rank) * tp + tp_rank, so the ranks of one tensor-parallel group
are consecutive and sit inside one node when tp divides the ranks per node.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from boostmpi.errors import ConfigError
from boostmpi.parallel.comm import CommCounter, Communicator, Group, HostCollectives

if TYPE_CHECKING:
    from mpi4py import MPI


@dataclass(frozen=True)
class Coords:
    dp: int
    pp: int
    tp: int


def coords_of(world_rank: int, tp: int, pp: int, dp: int) -> Coords:
    tp_rank = world_rank % tp
    pp_rank = (world_rank // tp) % pp
    dp_rank = world_rank // (tp * pp)
    return Coords(dp_rank, pp_rank, tp_rank)


def rank_of(coords: Coords, tp: int, pp: int) -> int:
    return (coords.dp * pp + coords.pp) * tp + coords.tp


class ProcessGrid:
    """Axis groups of this rank. `world` is an mpi4py communicator or None (one process). `ring`: the
    pipeline's messages go round a ring (interleaved 1F1B), which NCCL needs channels for."""

    def __init__(self, world: MPI.Comm | None, tp: int = 1, pp: int = 1, dp: int = 1, overlap: bool = True,
                 sync: Callable[[], None] | None = None, use_nccl: bool = False, ring: bool = False) -> None:
        size = 1 if world is None else world.Get_size()
        rank = 0 if world is None else world.Get_rank()
        if tp * pp * dp != size:
            raise ConfigError(
                f"parallel.tp * parallel.pp * parallel.dp = {tp * pp * dp} but {size} MPI ranks were started"
            )
        self.world, self.world_size, self.world_rank = world, size, rank
        self.tp_size, self.pp_size, self.dp_size = tp, pp, dp
        self.coords = coords_of(rank, tp, pp, dp)
        self.counter = CommCounter()
        self.host = HostCollectives(world)  # bookkeeping over all ranks, watched, not counted
        c = self.coords

        def split(color: int, key: int, n: int) -> MPI.Comm | None:
            if world is None or n == 1:
                return None
            return world.Split(color, key)

        def group(axis: str, comm: MPI.Comm | None) -> Group:
            if use_nccl and comm is not None:
                from boostmpi.parallel.nccl import NcclGroup

                return NcclGroup(axis, comm, self.counter, overlap, p2p=axis == "pp", ring=ring and axis == "pp")
            return Group(axis, comm, self.counter, overlap, sync)

        self.use_nccl = use_nccl
        self.tp: Communicator = group("tp", split(c.dp * pp + c.pp, c.tp, tp))
        self.pp: Communicator = group("pp", split(c.dp * tp + c.tp, c.pp, pp))
        self.dp: Communicator = group("dp", split(c.pp * tp + c.tp, c.dp, dp))

    @property
    def is_first_stage(self) -> bool:
        return self.coords.pp == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coords.pp == self.pp_size - 1
