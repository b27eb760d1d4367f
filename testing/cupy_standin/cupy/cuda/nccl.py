"""`cupy.cuda.nccl` of the stand-in: NCCL communicators carried out by mpi4py between the real ranks.

Each NcclCommunicator owns an MPI communicator over exactly its members (made with
`MPI_Comm_create_group`, so only the members take part), and each operation is device work
queued on the stream it was given (cuda/_queue.py):
- it starts when everything its stream covers has finished, and an operation whose stream does
  not cover every earlier operation of the same communicator (one the host has not waited for
  since) is refused (NcclOrderError): NCCL
  runs a communicator's operations in issue order, and two of them on unordered streams may run
  at once and hang or mix their data;
- `send` is a synchronous-mode MPI send: it completes only once the peer has posted the matching
  receive, which is NCCL's rule (its stream is blocked until then);
- `allReduce` (and `reduce`, which writes on its root only) gathers every member's contribution and
  combines them in the order of NCCL's ring (`ring_sum`): every hop adds one member's part and
  rounds to the buffer's dtype (16-bit floats are added in float32 and rounded back at each of the
  p-1 hops, as NCCL's reduction kernels do); every member gets the same bits, as with NCCL.
Data is read from device memory when the operation starts and written when it finishes. For the
order tracking (cuda/_order.py) an operation reads its send buffer and writes its receive buffer
on its stream, at the moment it is enqueued.
"""

import itertools

import numpy as np

from cupy._memory import host_view
from cupy.cuda import _order, _queue

available = True  # CuPy's flag: the NCCL library loaded

NCCL_INT8, NCCL_CHAR, NCCL_UINT8, NCCL_INT32, NCCL_INT, NCCL_UINT32 = 0, 0, 1, 2, 2, 3
NCCL_INT64, NCCL_UINT64, NCCL_FLOAT16, NCCL_HALF, NCCL_FLOAT32, NCCL_FLOAT = 4, 5, 6, 6, 7, 7
NCCL_FLOAT64, NCCL_DOUBLE, NCCL_BFLOAT16 = 8, 8, 9
NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN, NCCL_AVG = 0, 1, 2, 3, 4


_DTYPES = {NCCL_INT8: "int8", NCCL_UINT8: "uint8", NCCL_INT32: "int32", NCCL_UINT32: "uint32", NCCL_INT64: "int64",
           NCCL_UINT64: "uint64", NCCL_FLOAT16: "float16", NCCL_FLOAT32: "float32", NCCL_FLOAT64: "float64",
           NCCL_BFLOAT16: "bfloat16"}
_REDUCE = {NCCL_SUM: np.add, NCCL_PROD: np.multiply, NCCL_MAX: np.maximum, NCCL_MIN: np.minimum}
_TAG_BASE = 23000  # COMM_WORLD tags of the rendezvous that makes a communicator
_serial = itertools.count()


class NcclError(RuntimeError):
    pass


class NcclOrderError(NcclError):
    """Two operations of one communicator are not ordered on the device."""


def _dtype(code):
    name = _DTYPES.get(code)
    if name is None:
        raise NcclError(f"ncclInvalidArgument: unknown datatype {code}")
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _ring_chunks(count, size):
    """NCCL's ring all-reduce cuts the buffer into one chunk per member (contiguous, near-equal here)."""
    return [(c * count // size, (c + 1) * count // size) for c in range(size)]


def ring_sum(parts, dt, op=NCCL_SUM, root=None):
    """parts [size, count] (one row per member, dtype dt) combined as NCCL's ring does.

    All-reduce (NCCL's runRing in src/device/all_reduce.h: reduce-scatter, then all-gather,
    https://github.com/NVIDIA/nccl/blob/master/src/device/all_reduce.h): chunk c starts at
    member c+1, which sends its part to c+2; each member adds its own part to what it received and
    sends the result on, so the partial sum is rounded to the buffer's dtype at each of the p-1 hops
    and is complete at member c, which then passes it around unchanged. Reduce (src/device/reduce.h):
    one chain for the whole buffer from root+1 around to the root. 16-bit floats are added in float32 and
    rounded back at every hop; wider types round in their own precision; integers are exact.
    The real ring follows the interconnect (not necessarily rank order) and cuts the buffer into
    chunks per channel and step; this model keeps the per-hop rounding and one fixed order per chunk."""
    size, count = parts.shape
    work = np.float32 if dt.itemsize == 2 and dt.kind not in "iu" else dt
    fn = _REDUCE[op]
    out = np.empty(count, dt)
    if root is not None:
        spans = [(0, count, root)]
    else:
        spans = [(lo, hi, c) for c, (lo, hi) in enumerate(_ring_chunks(count, size))]
    for lo, hi, last in spans:
        order = [(last + k) % size for k in range(1, size + 1)]  # ends at `last`
        total = parts[order[0], lo:hi]
        for member in order[1:]:
            total = fn(total.astype(work), parts[member, lo:hi].astype(work)).astype(dt)
        out[lo:hi] = total
    return out


def get_version():
    return 22105


def get_build_version():
    return 22105


def get_unique_id():
    """A token naming the maker (its world rank) and a serial number of its own."""
    from mpi4py import MPI

    return (0x4E43434C, MPI.COMM_WORLD.Get_rank(), next(_serial))


def _device_bus_id():
    from cupy.cuda import Device

    return Device().pci_bus_id


def _stream(stream):
    """The stand-in Stream for a raw pointer (0: the null stream)."""
    if isinstance(stream, _queue.Stream):
        return stream
    for s in _queue.Stream._live:
        if s.ptr == stream:
            return s
    raise NcclError(f"ncclInvalidArgument: {stream:#x} is not a stream of this process")


def groupStart():
    """NCCL's group calls: the stand-in runs the grouped operations one after the other, in issue
    order, which every member shares (what a group may reorder cannot deadlock here)."""


def groupEnd():
    pass


class NcclCommunicator:
    def __init__(self, ndev, commId, rank):
        from mpi4py import MPI

        if not (isinstance(commId, tuple) and len(commId) == 3 and commId[0] == 0x4E43434C):
            raise NcclError("ncclInvalidArgument: the unique id was not made by get_unique_id()")
        world = MPI.COMM_WORLD
        _, root, serial = commId
        tag = _TAG_BASE + serial % 5000
        me = world.Get_rank()
        gpu = (MPI.Get_processor_name(), _device_bus_id())
        if me == root:  # the maker learns every member's world rank and GPU, then tells them all
            members = {rank: (me, gpu)}
            for _ in range(ndev - 1):
                r, w, their_gpu = world.recv(source=MPI.ANY_SOURCE, tag=tag)
                members[r] = (w, their_gpu)
            problem = None
            if sorted(members) != list(range(ndev)):
                problem = f"ncclInvalidUsage: ranks {sorted(members)} joined a communicator of {ndev}"
            elif len({g for _, g in members.values()}) < ndev:  # NCCL: "Duplicate GPU detected"
                problem = f"ncclInvalidUsage: duplicate GPU detected among {sorted(members.values())}"
            order = [members[r][0] for r in sorted(members)]
            for w in order:
                if w != me:
                    world.send((order, problem), dest=w, tag=tag)
        else:
            world.send((rank, me, gpu), dest=root, tag=tag)
            order, problem = world.recv(source=root, tag=tag)
        if problem:
            raise NcclError(problem)
        self._mpi = world.Create_group(world.Get_group().Incl(order), tag=tag)
        self._rank, self._size = rank, ndev
        self._issued = []  # every op of this communicator, in issue order

    def rank_id(self):
        return self._rank

    def size(self):
        return self._size

    def device_id(self):
        from cupy.cuda import Device

        return Device().id

    def destroy(self):
        if self._mpi is not None:
            self._mpi.Free()
            self._mpi = None

    def abort(self):
        """ncclCommAbort: every operation of the communicator still pending, and any issued later, ends
        with an error. Called from the watchdog's thread, so it makes no MPI call."""
        self._aborted = True

    # -- queueing
    def _enqueue(self, what, stream, start, test, finish=None, touches=()):
        """Queue an op on `stream`; `touches`: (device pointer, bytes, writes?) it reads or writes."""
        if self._mpi is None or getattr(self, "_aborted", False):
            raise NcclError("ncclInvalidUsage: the communicator was destroyed or aborted")
        stream = _stream(stream)
        from cupy import _memory
        from cupy.cuda import graph

        capture = graph.device_work(stream)
        if _memory.META and capture is None:  # shapes only: queued and ordered as always, no data moves
            start, test, finish = (lambda: None), (lambda: True), None
        op = _queue.DeviceOp(f"NCCL {what} on communicator rank {self._rank}/{self._size}", start, test, finish)
        unordered = [earlier for earlier in self._issued if earlier.id not in stream.covered | _queue._synced]
        if unordered and capture is None:
            raise NcclOrderError(f"{op.what} on stream {stream.ptr:#x} is not ordered after {unordered} of the same "
                                 f"communicator: NCCL may run them at once (make the stream wait for them)")
        issued, where = _order.issue(stream), _order.call_site()
        writes = {ptr for ptr, _, w in touches if w}
        for ptr, nbytes, write in touches:
            if write or ptr not in writes:  # in place: the write covers the read
                _order.access_pointer(ptr, nbytes, write, issued, f"NCCL {what}", where)
        if capture is not None:  # recorded: queued on the launch stream at each launch (nothing moves now)
            graph.record_quiet(capture, f"NCCL {what}", lambda: self._enqueue(what, _queue.get_current_stream(), start,
                                                                               test, finish, touches),
                               [host_view(ptr, nbytes)[1] for ptr, nbytes, _ in touches], always=True)
            return
        self._issued.append(op)
        _queue.enqueue(stream, op)

    def _requests(self):
        state = {"reqs": []}

        def test():
            from mpi4py import MPI

            if getattr(self, "_aborted", False):
                raise NcclError("ncclSystemError: the communicator was aborted (ncclCommAbort)")
            return MPI.Request.Testall(state["reqs"])

        return state, test

    # -- collectives
    def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream):
        self._reduce(f"allReduce of {count}", sendbuf, recvbuf, count, datatype, op, stream)

    def _reduce(self, what, sendbuf, recvbuf, count, datatype, op, stream, root=None):
        dt = _dtype(datatype)
        if op not in _REDUCE:
            raise NcclError(f"ncclInvalidArgument: reduction {op}")
        nbytes = count * dt.itemsize
        send, _ = host_view(sendbuf, nbytes)
        recv, _ = host_view(recvbuf, nbytes)
        gathered = np.empty((self._size, nbytes), np.uint8)
        state, test = self._requests()

        def start():
            state["reqs"] = [self._mpi.Iallgather(send.copy(), gathered)]

        def finish():
            if root is None or root == self._rank:
                recv.view(dt)[...] = ring_sum(gathered.view(dt).reshape(self._size, count), dt, op, root)

        writes = root is None or root == self._rank
        self._enqueue(f"{what} x {dt}", stream, start, test, finish,
                      [(sendbuf, nbytes, False), (recvbuf, nbytes, writes)][:2 if writes else 1])

    def reduce(self, sendbuf, recvbuf, count, datatype, op, root, stream):
        """The sum (op) of every member's buffer, along NCCL's chain from root+1 to the root (`ring_sum`),
        written on `root` only."""
        self._reduce(f"reduce of {count} to {root}", sendbuf, recvbuf, count, datatype, op, stream, root)

    def allGather(self, sendbuf, recvbuf, count, datatype, stream):
        dt = _dtype(datatype)
        nbytes = count * dt.itemsize
        send, _ = host_view(sendbuf, nbytes)
        recv, _ = host_view(recvbuf, nbytes * self._size)
        gathered = np.empty(nbytes * self._size, np.uint8)
        state, test = self._requests()

        def start():
            state["reqs"] = [self._mpi.Iallgather(send.copy(), gathered)]

        def finish():
            recv[...] = gathered

        self._enqueue(f"allGather of {count} x {dt}", stream, start, test, finish,
                      [(sendbuf, nbytes, False), (recvbuf, nbytes * self._size, True)])

    def broadcast(self, sendbuf, recvbuf, count, datatype, root, stream):
        dt = _dtype(datatype)
        nbytes = count * dt.itemsize
        recv, _ = host_view(recvbuf, nbytes)
        send = host_view(sendbuf, nbytes)[0] if self._rank == root else None
        data = np.empty(nbytes, np.uint8)
        state, test = self._requests()

        def start():
            if send is not None:
                data[...] = send
            state["reqs"] = [self._mpi.Ibcast(data, root=root)]

        def finish():
            recv[...] = data

        self._enqueue(f"broadcast of {count} x {dt} from {root}", stream, start, test, finish,
                      [(sendbuf, nbytes, False)] if self._rank == root and sendbuf == recvbuf else
                      [(sendbuf, nbytes, False)] * (self._rank == root) + [(recvbuf, nbytes, True)])

    # -- point to point
    def send(self, sendbuf, count, datatype, peer, stream):
        dt = _dtype(datatype)
        send, _ = host_view(sendbuf, count * dt.itemsize)
        state, test = self._requests()

        def start():
            state["reqs"] = [self._mpi.Issend(send.copy(), dest=peer, tag=0)]

        self._enqueue(f"send of {count} x {dt} to {peer}", stream, start, test, None,
                      [(sendbuf, count * dt.itemsize, False)])

    def recv(self, recvbuf, count, datatype, peer, stream):
        dt = _dtype(datatype)
        recv, _ = host_view(recvbuf, count * dt.itemsize)
        data = np.empty(count * dt.itemsize, np.uint8)
        state, test = self._requests()

        def start():
            state["reqs"] = [self._mpi.Irecv(data, source=peer, tag=0)]

        def finish():
            recv[...] = data

        self._enqueue(f"recv of {count} x {dt} from {peer}", stream, start, test, finish,
                      [(recvbuf, count * dt.itemsize, True)])
