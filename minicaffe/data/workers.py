"""Worker processes that read, parse and decode records into a ring of shared batch slots
(the multi-process half of Caffe's ``base_data_layer.cpp`` prefetch; PyTorch's DataLoader
workers and DALI's CPU stage play the same part).

Contract:

- ``SlotRing(n_slots, batch, shape, dtype)``: ``n_slots`` batch slots, each a
  ``(batch,) + shape`` array of ``dtype`` (uint8 for ``data`` Datums and images, float32
  for ``float_data``) and ``batch`` float32 labels, in one shared-memory file.  The file
  (``/dev/shm/minicaffe-*`` on Linux, the temporary directory elsewhere) is unlinked as
  soon as every worker has mapped it, so no segment outlives the processes whatever way
  they end (normal end, Ctrl-C, SIGTERM, an error, kill -9).
- ``WorkerPool(n, source, ring, ...)`` starts ``n`` processes with the ``spawn`` start
  method (on every OS; a user's script is not re-imported by them: ``__main__`` is hidden
  while they start).  ``submit(slot, items)`` splits a batch's records (database keys, or
  image paths) in ``n`` consecutive chunks, one per worker; ``wait(slot)`` blocks until
  every chunk is in the slot and raises ``MinicaffeError`` with the first failing
  record's message (the layer adds its name): a corrupt record, a record of another
  shape, an undecodable image, or a worker that died (``kill -9``, out of memory, a
  decoder crash), never a hang.  ``close()`` stops and reaps every worker.
- Workers only read and decode: the random draws (crop offsets, mirror) and the
  transformation stay in the consumer, in Caffe's order, so a batch does not depend on
  the number of workers.  Workers ignore SIGINT, SIGHUP and SIGTERM (the training process
  decides how to stop) and exit when their pipe to it closes.
"""
import collections
import contextlib
import errno
import mmap
import multiprocessing
import os
import secrets
import signal
import sys
import tempfile
import threading
import time
import types
from multiprocessing import connection

import numpy as np

from ..core.config import usable_cpus
from ..core.errors import MinicaffeError

ENV = "MINICAFFE_DECODE_THREADS"
START_TIMEOUT = 60.0      # seconds for a worker to start and map the ring
_ALIGN = 4096


def shm_dir():
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) \
        else tempfile.gettempdir()


def _layout(n_slots, batch, shape, dtype):
    itemsize = np.dtype(dtype).itemsize
    data_bytes = batch * int(np.prod(shape)) * itemsize
    label_bytes = batch * 4
    slot_bytes = -(-(data_bytes + label_bytes) // _ALIGN) * _ALIGN
    return data_bytes, slot_bytes, n_slots * slot_bytes


def _reserve(fd, nbytes, path):
    """Reserve the file's pages now: a /dev/shm too small for it (a container's default
    64 MB) is one error line here, not a SIGBUS when a page is first written."""
    if not hasattr(os, "posix_fallocate"):
        return
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.ENOMEM):
            raise MinicaffeError(
                f"{os.path.dirname(path)}: no room for {nbytes / 2 ** 20:.1f} MiB of shared "
                f"memory ({e.strerror}); free some, or give the container more (docker run "
                "--shm-size)") from None
        # a file system without fallocate: the pages come on first touch


def map_shared_file(nbytes, path=None, prefix="minicaffe"):
    """(path, mmap) of a new shared-memory file of ``nbytes`` (``path`` None: created in
    /dev/shm, or the temporary directory, readable by this user only) or of the existing
    file ``path``.  The caller unlinks a new one once every process has mapped it."""
    new = path is None
    if new:
        path = os.path.join(shm_dir(), f"{prefix}-{os.getpid()}-{secrets.token_hex(6)}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    else:
        fd = os.open(path, os.O_RDWR)
    try:
        if new:
            os.ftruncate(fd, nbytes)
            _reserve(fd, nbytes, path)
        mm = mmap.mmap(fd, nbytes)
    except BaseException:
        os.close(fd)
        if new:
            os.unlink(path)
        raise
    os.close(fd)
    return path, mm


class SlotRing:
    """``n_slots`` batch slots in one shared-memory file (see the module docstring)."""

    def __init__(self, n_slots, batch, shape, dtype, path=None):
        self.n_slots, self.batch = int(n_slots), int(batch)
        self.shape, self.dtype = tuple(int(d) for d in shape), np.dtype(dtype)
        self.data_bytes, self.slot_bytes, self.nbytes = _layout(n_slots, batch, shape, dtype)
        self.owner = path is None
        self.path, self._mm = map_shared_file(self.nbytes, path)
        self._buf = np.frombuffer(self._mm, dtype=np.uint8)

    def spec(self):
        return (self.path, self.n_slots, self.batch, self.shape, self.dtype.str)

    @classmethod
    def attach(cls, spec):
        path, n_slots, batch, shape, dtype = spec
        return cls(n_slots, batch, shape, np.dtype(dtype), path=path)

    def data(self, slot):
        o = slot * self.slot_bytes
        return self._buf[o:o + self.data_bytes].view(self.dtype).reshape((self.batch,) + self.shape)

    def labels(self, slot):
        o = slot * self.slot_bytes + self.data_bytes
        return self._buf[o:o + 4 * self.batch].view(np.float32)

    def address(self):
        """The host address of the mapping (to page-lock it for uploads)."""
        return self._buf.ctypes.data

    def unlink(self):
        """Remove the file's name (the memory lives on while it is mapped)."""
        if self.owner and self.path is not None:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            self.path = None

    def close(self):
        self.unlink()
        self._buf = None
        try:
            self._mm.close()
        except (BufferError, ValueError):  # a view is still alive: the GC unmaps it later
            pass


# -- the settings -------------------------------------------------------------------------
def requested_workers(field_set, field_value, config=None):
    """(count, where it was set) from the run's ``config.data_workers`` (``minicaffe train
    --data_workers``, else $MINICAFFE_DECODE_THREADS, read by config.py), else
    ``data_param.workers``; (None, None) when neither is set (the layer chooses:
    ``default_workers``)."""
    if config is None:
        from ..core.config import RunConfig
        config = RunConfig.from_environment()
    if config.data_workers is not None:
        return int(config.data_workers), f"--data_workers or ${ENV}"
    if field_set:
        return int(field_value), "data_param.workers"
    return None, None


def default_workers(solver_count=1):
    """The cores less two (the training thread and the prefetch thread), divided among the
    solvers of this machine, at least 1 and at most 16."""
    return max(1, min(16, (usable_cpus() - 2) // max(1, int(solver_count))))


# -- the worker process -------------------------------------------------------------------
class DBSource:
    """What a worker needs to read Datums by key."""

    def __init__(self, path, backend, color):
        self.path, self.backend, self.color = path, backend, color

    def open(self):
        from .db import open_db
        self.db = open_db(self.path, self.backend)
        if self.db.backend == "lmdb":
            self.txn = self.db.env.begin(buffers=False)
            self.get = self.txn.get
        else:
            self.get = self.db.get

    def read(self, item):
        """(image, label, where) of one record: ``item`` is (key, where)."""
        from .db import datum_to_array, parse_datum
        key, where = item
        value = self.get(key)
        if value is None:
            raise MinicaffeError(f"{where}: the record is gone (was the database rewritten "
                                 "while training?)")
        d = parse_datum(value, where)
        return datum_to_array(d, where, self.color), d.label, where


class ImageSource:
    """What a worker needs to read images of a list file."""

    def __init__(self, new_h, new_w, is_color):
        self.new_h, self.new_w, self.is_color = new_h, new_w, is_color

    def open(self):
        pass

    def read(self, item):
        from .images import read_image
        path, label, where = item
        return read_image(path, self.new_h, self.new_w, self.is_color, where=where), label, where


def _fmt(shape):
    return "x".join(str(d) for d in shape)


def mismatch_message(kind, where, shape, ref, first):
    """The one-line message of a record whose shape is not the first record's."""
    if kind == "db":
        return (f"{where}: Datum shape {_fmt(shape)} differs from the first datum's {_fmt(ref)}"
                + (" (records of one shape are needed unless batch_size is 1)" if first else ""))
    return (f"{where}: image of shape {_fmt(shape)} differs from the "
            + (f"first image's {_fmt(ref)}; set new_height/new_width or use batch_size 1"
               if first else f"batch's first {_fmt(ref)}; set new_height/new_width"))


def _fill(source, ring, kind, slot, offset, items):
    out, labels = ring.data(slot), ring.labels(slot)
    for j, item in enumerate(items):
        img, label, where = source.read(item)
        if img.shape != ring.shape:
            raise MinicaffeError(mismatch_message(kind, where, img.shape, ring.shape,
                                                  offset + j == 0))
        if img.dtype != ring.dtype and ring.dtype == np.uint8:
            raise MinicaffeError(f"{where}: the Datum holds float_data but the first record "
                                 "holds uint8 data; a database holds one kind")
        out[offset + j] = img
        labels[offset + j] = label


def _worker_main(conn, kind, source, ring_spec):
    for name in ("SIGINT", "SIGHUP", "SIGTERM"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_IGN)
    try:
        ring = SlotRing.attach(ring_spec)
        source.open()
    except Exception as e:  # reported by the pool as one line
        conn.send(("init", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return  # the training process is gone
        if msg is None:
            return
        slot, offset, seq, items = msg
        try:
            _fill(source, ring, kind, slot, offset, items)
            reply = (slot, offset, seq, None)
        except MinicaffeError as e:
            reply = (slot, offset, seq, str(e))
        except Exception as e:
            where = items[0][-1] if items else "data worker"
            reply = (slot, offset, seq, f"{where}: the data worker failed: {type(e).__name__}: {e}")
        try:
            conn.send(reply)
        except (EOFError, OSError):
            return


# -- the pool -------------------------------------------------------------------------------
_main_lock = threading.Lock()


@contextlib.contextmanager
def main_hidden():
    """Start spawned children without re-importing the user's ``__main__`` (its script
    is not re-executed, guarded by ``if __name__ == "__main__"`` or not)."""
    with _main_lock:
        main = sys.modules.get("__main__")
        sys.modules["__main__"] = types.ModuleType("__main__")
        try:
            yield
        finally:
            if main is not None:
                sys.modules["__main__"] = main


def death_cause(proc):
    code = proc.exitcode
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


def first_messages(procs, conns, who, recv=lambda c: c.recv(), timeout=START_TIMEOUT):
    """Each started worker's first message (``recv(conn)``), in order; a MinicaffeError
    '``who(i)`` did not start (why)' when worker i dies first or is later than ``timeout``
    seconds in all."""
    deadline = time.monotonic() + timeout
    out = []
    for i, (p, c) in enumerate(zip(procs, conns)):
        while not c.poll(0.05):
            if not p.is_alive():
                raise MinicaffeError(f"{who(i)} did not start ({death_cause(p)})")
            if time.monotonic() > deadline:
                raise MinicaffeError(f"{who(i)} did not start within {timeout:.0f} s")
        out.append(recv(c))
    return out


def stop_workers(procs, conns, goodbye, timeout=2.0):
    """Stop and reap worker processes: ``goodbye(conn)`` asks each to end, those still
    alive after ``timeout`` seconds are terminated (then killed); no child is left."""
    for c in conns:
        try:
            goodbye(c)
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.join(max(0.0, deadline - time.monotonic()))
        except ValueError:       # closed already
            continue
    for p in procs:
        try:
            if p.is_alive():
                p.terminate()
                p.join(1.0)
            if p.is_alive():
                p.kill()
                p.join(1.0)
        except ValueError:
            continue
    for c in conns:
        c.close()
    for p in procs:
        try:
            p.close()
        except ValueError:
            pass


class WorkerPool:
    def __init__(self, n, kind, source, ring, describe="data layer"):
        self.kind, self.ring, self.describe = kind, ring, describe
        self.n = int(n)
        self.closed = False
        self.interrupted = False
        self.pending = {}     # slot -> {worker: (offset, where of its chunk's first record)}
        self.errors = {}      # slot -> {offset: message}
        self.seq = {}         # slot -> the number of its latest submission (older replies
        self._count = 0       #         are of batches forgotten by ``drain``)
        self.procs, self.conns = [], []
        ctx = multiprocessing.get_context("spawn")
        try:
            for i in range(self.n):
                parent, child = ctx.Pipe(duplex=True)
                p = ctx.Process(target=_worker_main, args=(child, kind, source, ring.spec()),
                                name=f"minicaffe-data-{i}", daemon=True)
                with main_hidden():
                    p.start()
                child.close()
                self.procs.append(p)
                self.conns.append(parent)
            hellos = first_messages(self.procs, self.conns,
                                    lambda i: f"{describe}: data worker {i}")
            for i, (tag, detail) in enumerate(hellos):
                if tag != "ready":
                    raise MinicaffeError(f"{describe}: data worker {i} could not open the "
                                         f"source: {detail}")
        except BaseException:
            self.close()
            raise
        finally:
            ring.unlink()

    @property
    def pids(self):
        return [p.pid for p in self.procs]

    def submit(self, slot, items, where_of):
        """Hand the records ``items`` of batch slot ``slot`` to the workers in consecutive
        chunks; ``where_of(item)`` names a record in messages."""
        n = len(items)
        k = min(self.n, n)
        bounds = [n * i // k for i in range(k + 1)]
        self.pending[slot] = {}
        self.errors[slot] = {}
        self._count += 1
        self.seq[slot] = self._count
        for w in range(k):
            chunk = items[bounds[w]:bounds[w + 1]]
            self.pending[slot][w] = (bounds[w], where_of(chunk[0]))
            try:
                self.conns[w].send((slot, bounds[w], self._count, chunk))
            except (OSError, ValueError):
                pass  # a dead worker: ``wait`` reports it

    def _receive(self, w):
        slot, offset, seq, err = self.conns[w].recv()
        if seq != self.seq.get(slot):
            return  # a batch ``drain`` forgot
        self.pending.get(slot, {}).pop(w, None)
        if err is not None:
            self.errors.setdefault(slot, {})[offset] = err

    def wait(self, slot):
        """Block until slot ``slot`` is filled; MinicaffeError on a failed record or a dead
        worker (or ``interrupt``)."""
        while self.pending.get(slot):
            if self.interrupted or self.closed:
                raise MinicaffeError(f"{self.describe}: the data workers were stopped")
            busy = {w for s in self.pending.values() for w in s}
            waitables = {self.conns[w]: w for w in busy}
            waitables.update({self.procs[w].sentinel: w for w in busy})
            ready = connection.wait(list(waitables), timeout=0.25)
            for obj in ready:
                w = waitables[obj]
                c = self.conns[w]
                try:
                    while c.poll():
                        self._receive(w)
                except (EOFError, OSError):
                    pass
                if obj is self.procs[w].sentinel or not self.procs[w].is_alive():
                    if any(w in s for s in self.pending.values()):
                        self.procs[w].join(1)
                        where = next(s[w][1] for s in self.pending.values() if w in s)
                        raise MinicaffeError(
                            f"{where}: data worker {w} (pid {self.procs[w].pid}) died "
                            f"({death_cause(self.procs[w])}) while reading this record or the ones "
                            "after it; training stops")
        self.pending.pop(slot, None)
        errors = self.errors.pop(slot, {})
        if errors:
            raise MinicaffeError(errors[min(errors)])

    def drain(self):
        """Wait for every submitted chunk and forget the results (a new position)."""
        self.interrupted = False
        for slot in list(self.pending):
            try:
                self.wait(slot)
            except MinicaffeError:
                pass
        self.pending.clear()
        self.errors.clear()
        self.seq.clear()

    def close(self, timeout=2.0):
        """Stop and reap every worker (no child process is left)."""
        if self.closed:
            return
        self.closed = True
        stop_workers(self.procs, self.conns, lambda c: c.send(None), timeout)


class WorkerFeed:
    """The prefetch thread's side of a pool: keeps every slot of the ring in flight and
    hands the slots back filled in the order their records were read."""

    def __init__(self, pool, ring, pin=False):
        self.pool, self.ring = pool, ring
        self.inflight = collections.deque()   # (slot, items, position after them)
        self.free = list(range(ring.n_slots))
        self.pinned = None
        if pin:  # GPU mode: uploads from the ring become asynchronous DMA
            from ..core import backend
            if backend.register_host(ring.address(), ring.nbytes):
                self.pinned = ring.address()

    def next(self, read_items, position):
        """(slot, items, position after them) of the next batch; ``read_items()`` reads
        the records of one batch, ``position()`` says where the reader is after them."""
        while self.free:
            slot = self.free.pop(0)
            items = read_items()
            self.inflight.append((slot, items, position()))
            self.pool.submit(slot, items, lambda item: item[-1])
        slot, items, pos = self.inflight.popleft()
        try:
            self.pool.wait(slot)
        except BaseException:
            self.free.append(slot)
            raise
        return slot, items, pos

    def release(self, slot):
        self.free.append(slot)

    def reset(self):
        """Forget the batches in flight (the reader moves to another position)."""
        self.pool.drain()
        self.pool.interrupted = False
        self.inflight.clear()
        self.free = list(range(self.ring.n_slots))

    def interrupt(self):
        self.pool.interrupted = True

    def close(self):
        self.pool.close()
        if self.pinned is not None:
            from ..core import backend
            backend.unregister_host(self.pinned)
            self.pinned = None
        self.ring.close()
