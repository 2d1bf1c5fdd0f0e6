"""Communicators for data-parallel training: NCCL between GPUs, a fake one between CPU threads.

A communicator joins ``size`` ranks; each rank holds its own object and every rank must
issue the same collectives in the same order.  The interface is small (Chainer's
pure_nccl_communicator is the model):

- ``allreduce(array, stream=None)``: sum ``array`` over the ranks, in place (a slice of
  the flat diff buffer: no packing);
- ``bcast(array, root=0, stream=None)``: copy the root's ``array`` to every rank;
- ``allreduce_host(values)``: the sum over the ranks of a few host numbers (float64),
  blocking: test scores, images/s, start-up state;
- ``barrier()``; ``abort()`` (callable from any thread: ends every pending and later
  collective of this rank with :class:`CommAborted`); ``close()``.

A communicator kind is a class with ``new_uid(size)`` (made once, by one rank, and
handed to every rank) and the constructor ``Kind(size, uid, rank)``:

- :class:`NcclComm`: NCCL through ``gpu/nccl.py`` (CuPy's ``cupy.cuda.nccl``).  The uid
  is NCCL's unique id (``bytes``); collectives take raw pointers and run on the given CUDA
  stream.  The NCCL variables that keep NVLink multicast off (``NCCL_NVLS_ENABLE=0``) are
  set unless the user set them.
- :class:`FakeComm`: ranks are threads of one process in CPU mode exchanging numpy
  arrays through shared memory and a barrier; the uid is the shared :class:`FakeWorld`.
  It makes the whole multi-GPU machinery run, and be tested, on a CPU.

Sharing a uid between processes: :func:`share_uid_by_file` (``--init_file``) and
:func:`share_uid_by_mpi` (mpirun, with the optional mpi4py).
"""
import json
import os
import threading
import time

import numpy as np

from ..core import backend
from ..core.errors import MinicaffeError
from ..gpu import nccl as _nccl


class CommAborted(MinicaffeError):
    """A collective was cut short: a rank failed or the run was stopped."""


class Comm:
    """The communicator interface (see the module docstring)."""

    rank = 0
    size = 1

    def allreduce(self, array, stream=None):
        raise NotImplementedError

    def bcast(self, array, root=0, stream=None):
        raise NotImplementedError

    def allreduce_host(self, values):
        raise NotImplementedError

    def barrier(self):
        self.allreduce_host([0.0])

    def abort(self):
        pass

    def close(self):
        pass


# -- the fake communicator: threads of one process, numpy arrays ----------------------------
class FakeWorld:
    """What the ranks of a :class:`FakeComm` share: one slot per rank and a barrier.
    ``timeout`` (seconds) bounds every wait, so a test can never hang."""

    def __init__(self, size, timeout=60.0):
        self.size = int(size)
        self.timeout = timeout
        self.slots = [None] * self.size
        self.barrier = threading.Barrier(self.size)
        self.calls = 0  # collectives completed (by rank 0), for tests


class FakeComm(Comm):
    """Ranks are threads in CPU mode; arrays are numpy.  Every rank sums the slots in
    rank order, so every rank gets bit-identical results, as NCCL gives."""

    def __init__(self, size, uid, rank):
        if not isinstance(uid, FakeWorld) or uid.size != size:
            raise ValueError("FakeComm needs the FakeWorld made by FakeComm.new_uid(size)")
        self.world = uid
        self.size = int(size)
        self.rank = int(rank)

    @staticmethod
    def new_uid(size):
        return FakeWorld(size)

    def _wait(self):
        try:
            self.world.barrier.wait(self.world.timeout)
        except threading.BrokenBarrierError:
            raise CommAborted(f"rank {self.rank}: the collective was aborted") from None

    def _exchange(self, array, combine):
        w = self.world
        w.slots[self.rank] = array
        self._wait()                    # every rank has posted
        result = combine(w.slots)
        self._wait()                    # every rank has read
        array[...] = result
        if self.rank == 0:
            w.calls += 1

    def allreduce(self, array, stream=None):
        def total(slots):
            out = np.array(slots[0], copy=True)
            for s in slots[1:]:
                out += s
            return out
        self._exchange(array, total)

    def bcast(self, array, root=0, stream=None):
        self._exchange(array, lambda slots: np.array(slots[root], copy=True))

    def allreduce_host(self, values):
        a = np.array(values, dtype=np.float64).reshape(-1)
        self.allreduce(a)
        return a

    def barrier(self):
        self._wait()

    def abort(self):
        self.world.barrier.abort()


# -- NCCL (the bindings: gpu/nccl.py) -------------------------------------------------------------
def nccl_module():
    """``cupy.cuda.nccl``, or None when CuPy or its NCCL is missing."""
    return _nccl.module()


def why_no_nccl():
    return _nccl.why_missing()


keep_multicast_off = _nccl.keep_multicast_off


class NcclComm(Comm):
    """One NCCL communicator for this thread's device (``gpu/nccl.py``)."""

    def __init__(self, size, uid, rank):
        if nccl_module() is None:
            raise MinicaffeError(f"multi-GPU training needs NCCL: {why_no_nccl()}")
        keep_multicast_off()
        self.size = int(size)
        self.rank = int(rank)
        self._lock = threading.Lock()
        self._aborted = False
        self._comm = _nccl.Communicator(self.size, uid, self.rank)

    @staticmethod
    def new_uid(size=None):
        if nccl_module() is None:
            raise MinicaffeError(f"multi-GPU training needs NCCL: {why_no_nccl()}")
        keep_multicast_off()
        return _nccl.unique_id()

    def _check(self):
        if self._aborted:
            raise CommAborted(f"rank {self.rank}: the NCCL communicator was aborted")

    def _stream(self, stream):
        return stream if stream is not None else backend.current_stream()

    def allreduce(self, array, stream=None):
        self._check()
        self._comm.all_reduce(array, self._stream(stream))

    def bcast(self, array, root=0, stream=None):
        self._check()
        self._comm.bcast(array, root, self._stream(stream))

    def allreduce_host(self, values):
        cp = backend.gpu_module()
        stream = backend.current_stream()
        a = cp.asarray(np.array(values, dtype=np.float64).reshape(-1))
        self.allreduce(a, stream)
        out = cp.asnumpy(a, stream=stream)
        stream.synchronize()
        self._check()
        return out

    def abort(self):
        """ncclCommAbort: pending kernels of this communicator end; safe from any thread.
        NCCL's abort then waits until every CUDA graph that captured this communicator's
        collectives is destroyed (its owner's thread does that: ``GpuStep.release_graphs``),
        so the call runs without the GIL in a thread of its own, not waited for here (the
        abort flag is set at once; ``close`` waits)."""
        with self._lock:
            if self._aborted:
                return
            self._aborted = True

        def start(fn, args):
            t = threading.Thread(target=fn, args=args, name=f"nccl-abort-{self.rank}",
                                 daemon=True)
            self._abort_thread = t
            t.start()
            return t
        self._comm.abort_in_thread(start)

    def close(self):
        """At the end of a run: ncclCommAbort too, not ncclCommDestroy, which waits for the
        peers; waited for up to ABORT_WAIT_S seconds.  Destroy the captured graphs first
        (``GpuStep.release_graphs``)."""
        self.abort()
        t = getattr(self, "_abort_thread", None)
        if t is not None:
            t.join(ABORT_WAIT_S)


ABORT_WAIT_S = 10.0


# -- sharing the uid between processes ---------------------------------------------------------
def encode_uid(uid):
    """A NCCL unique id as text (CuPy 14 gives bytes; older CuPy a tuple of ints)."""
    if isinstance(uid, (bytes, bytearray)):
        return json.dumps({"bytes": bytes(uid).hex()})
    return json.dumps({"ints": [int(x) for x in uid]})


def decode_uid(text):
    d = json.loads(text)
    return bytes.fromhex(d["bytes"]) if "bytes" in d else tuple(d["ints"])


def share_uid_by_file(path, rank, make_uid, timeout=120.0, poll=0.05):
    """Rank 0 makes the uid and writes it to ``path`` (atomically: a temporary file, then
    rename); the other ranks wait for the file (sleeping between looks) and read it.
    The file must not exist when rank 0 starts: a file left by an earlier run would hand
    a stale id to ranks that start first."""
    path = os.fspath(path)
    if rank == 0:
        if os.path.exists(path):
            raise MinicaffeError(f"--init_file {path} already exists (left by an earlier run?): "
                                 "remove it or name a new file")
        d = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(d):
            raise MinicaffeError(f"--init_file {path}: no folder {d}")
        uid = make_uid()
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(encode_uid(uid))
        os.replace(tmp, path)
        return uid
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise MinicaffeError(f"rank {rank} waited {timeout:.0f} s for rank 0 to write the "
                                 f"NCCL id to --init_file {path}")
        time.sleep(poll)
    with open(path) as f:
        return decode_uid(f.read())


def mpi_world():
    """(comm, rank, size, local rank) of MPI.COMM_WORLD, or None without mpi4py."""
    try:
        from mpi4py import MPI
    except Exception:
        return None
    world = MPI.COMM_WORLD
    local = world.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()
    return world, world.Get_rank(), world.Get_size(), local


def share_uid_by_mpi(world, make_uid):
    """Rank 0 makes the uid; MPI broadcasts it (``world``: an mpi4py communicator)."""
    uid = make_uid() if world.Get_rank() == 0 else None
    return world.bcast(uid, root=0)


def launched_by_mpirun():
    """World size from the environment mpirun (Open MPI, MPICH/PMI, PMIx) gives its
    processes; 0 when not launched by mpirun."""
    for var in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS"):
        v = os.environ.get(var)
        if v and v.isdigit():
            return int(v)
    return 0
