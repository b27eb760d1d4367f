"""Host-side collectives (losses, norms, counters, flags, metadata): one helper, every call watched,
and one world-wide all-reduce per training step."""

import io

import numpy as np
from mpi4py import MPI

from boostmpi.config import config_from_dict
from boostmpi.data.shards import write_shard
from boostmpi.parallel.comm import WATCHDOG, HostCollectives
from boostmpi.train.trainer import Trainer
from tests.support.train_helpers import stop_signals_restored


class RecordingComm:
    """Stands in for a world communicator of one rank; records each call and whether the watchdog
    was watching it."""

    def __init__(self):
        self.calls = []

    def _note(self, name):
        self.calls.append((name, WATCHDOG._open is not None and WATCHDOG._open[0] == "world"))

    def Allreduce(self, sendbuf, recvbuf, op):
        assert sendbuf is MPI.IN_PLACE
        self._note("Allreduce")

    def bcast(self, obj, root=0):
        self._note("bcast")
        return obj

    def Barrier(self):
        self._note("Barrier")

    def allgather(self, obj):
        self._note("allgather")
        return [obj]

    def allreduce(self, value, op):  # what a raw mpi4py call would be: the watchdog would not see it
        self._note("allreduce")
        return value

    def Send(self, buf, dest, tag):
        self._note("Send")

    def Recv(self, buf, source, tag):
        self._note("Recv")


def test_every_host_collective_is_watched():
    comm = RecordingComm()
    host = HostCollectives(comm)
    assert list(host.sum([1.0, 2.0])) == [1.0, 2.0] and list(host.max([3.0])) == [3.0]
    assert host.bcast({"a": 1}) == {"a": 1}
    host.barrier()
    host.send(np.zeros(2), 0, 1)
    host.recv(np.zeros(2), 0, 1)
    assert [name for name, _ in comm.calls] == ["Allreduce", "Allreduce", "bcast", "Barrier", "Send", "Recv"]
    assert all(watched for _, watched in comm.calls), comm.calls
    assert WATCHDOG._open is None


def test_a_training_step_makes_one_world_all_reduce(tmp_path):
    """Loss, gradient norm, traffic counters and the stop flag travel together; the memory figures
    (a maximum) only on the steps that log them."""
    shard = tmp_path / "tokens.bin"
    write_shard(shard, np.frombuffer(b"the same short sentence, again and again. " * 40, dtype=np.uint8))
    steps, log_every = 6, 3
    cfg = config_from_dict({
        "model": {"arch": "cola", "vocab_size": 256, "d_model": 16, "n_layers": 1, "n_heads": 2,
                  "n_kv_heads": 2, "rank": 4, "d_ff": 32, "seq_len": 8},
        "train": {"run_dir": str(tmp_path / "run"), "steps": steps, "micro_batch_size": 2, "val_every": 0,
                  "val_windows": 2, "log_every": log_every},
        "data": {"train": str(shard), "val": str(shard)}})
    with stop_signals_restored():
        trainer = Trainer(cfg, out=io.StringIO())
        comm = RecordingComm()
        trainer.engine.grid.host = HostCollectives(comm)
        trainer.train()
    reductions = [name for name, _ in comm.calls if name == "Allreduce"]
    logged = len({1, steps} | set(range(log_every, steps + 1, log_every)))
    validations = 1  # the last step validates
    late_stops = 1  # and agrees on a stop signal that came after its all-reduce (during validation)
    assert len(reductions) == steps + logged + validations + late_stops, comm.calls


def start_up_calls(count_nodes):
    """The calls the start-up checks make on a world communicator, with whether each was watched."""
    from boostmpi.parallel import startup

    comm = RecordingComm()
    assert count_nodes(comm, 0) == 1
    startup.check_gpu_per_rank(comm, 0, "0000:41:00.0", environ={}, out=io.StringIO())
    return comm.calls


def test_the_start_up_checks_collectives_are_watched():
    """The start-up checks reduce and gather through HostCollectives, whose every call the watchdog
    watches; the mutant count_nodes with a raw mpi4py all-reduce is seen unwatched."""
    import inspect
    import textwrap

    from boostmpi.parallel import startup

    calls = start_up_calls(startup.count_nodes)
    assert [name for name, _ in calls] == ["Allreduce", "allgather"] and all(w for _, w in calls), calls

    source = textwrap.dedent(inspect.getsource(startup.count_nodes))
    watched = "int(HostCollectives(world).sum([int(local_rank == 0)])[0])"
    assert source.count(watched) == 1
    namespace = {}
    exec("from __future__ import annotations\n" + source.replace(watched, "world.allreduce(int(local_rank == 0), op=None)"),
         vars(startup), namespace)  # the module's annotations name types it imports only for the checker
    calls = start_up_calls(namespace["count_nodes"])
    assert not all(w for _, w in calls), calls
