"""The prefetch thread and the prefetching data layer base (Caffe's base_data_layer.cpp,
internal_thread.cpp and blocking_queue.cpp).

A prefetching layer owns ``prefetch`` batches (``DataParameter.prefetch``, default 4).
Each batch starts on the *free* queue; a background thread takes it, fills its host
buffers with the layer's loader, and puts it on the *full* queue.  ``forward`` hands
the previous batch back to the free queue, takes the next full one and points its tops
at the batch's memory (no copy), as Caffe's ``set_cpu_data``/``set_gpu_data`` do.

GPU mode: the host buffers are pinned (SyncedMemory pins host memory in GPU mode).
The thread uploads each batch with ``async_gpu_data`` on a non-blocking stream of its
own and records an event; ``forward`` makes the compute stream wait on that event
(``stream.wait_event``), so neither the main thread nor the compute stream waits for a
copy.  When a batch is handed back, an event is recorded on the compute stream and the
thread synchronises on it before writing that batch's buffers again, so a refill never
races a kernel still reading the previous contents.

The thread has its own manager state: it copies the parent's mode, device and solver
rank, and seeds its generator with a draw from the parent's (as Caffe's InternalThread
does with ``caffe_rng_rand()``).  It is a daemon thread, stopped by ``close()``, by the
layer's finalizer when the layer (its Net) is garbage-collected, and at interpreter exit.
An exception inside it is handed to the main thread through the full queue and raised
by the ``forward`` that would have consumed the failed batch, as a one-line error
naming the layer, the source and the record; ``forward`` never waits on a dead thread.
"""
import queue
import threading
import time
import traceback
import weakref

import numpy as np

from ..core import backend, context, log
from ..core.blob import Blob
from ..core.errors import MinicaffeError, WaitInterrupted
from ..layers.layer import Layer
from ..proto import caffe_pb2
from ..core.synced_memory import HEAD_AT_CPU
from .transformer import DataTransformer, TransformError


class Batch:
    """One prefetch slot: a data blob and an optional label blob."""

    def __init__(self, data_shape, label_shape=None, dtype=np.float32):
        self.data = Blob(data_shape, dtype)
        self.label = Blob(label_shape, dtype) if label_shape is not None else None
        self.ready = None      # event on the copy stream: the upload is done
        self.consumed = None   # event on the compute stream: the net is done with it
        self.position = None   # where the loader and its generator were after this batch

    def blobs(self):
        return [self.data] + ([self.label] if self.label is not None else [])


class _Failure:
    def __init__(self, message, detail):
        self.message = message
        self.detail = detail


_STOP = object()
STOP_TIMEOUT = 2.0   # seconds ``stop`` waits for a thread (a stalled read may never end)


def _position(loader, rng_state):
    """Where ``loader`` is (its ``position()``, if it has one) and the thread's generator."""
    position = getattr(loader, "position", None)
    out = dict(position()) if position is not None else {}
    out["rng"] = rng_state
    return out


class PrefetchThread:
    """Fills batches on a background thread with ``loader.load_batch(batch, rng)``.

    ``loader`` must not reference the layer (the layer's finalizer stops the thread);
    it may define ``close()``, called on the thread when it ends, ``interrupt()``, called
    by ``stop`` to end a wait inside ``load_batch``, and ``position()``, a
    dict of where it is (see ``BasePrefetchingDataLayer.data_position``).  Each batch
    records the position after it was loaded (``batch.position``), so the consumer knows
    where the records it has used end, however far the thread has read ahead.  A thread
    made with ``rng_state`` continues that generator instead of drawing a seed."""

    def __init__(self, loader, batches, describe="data layer", name="prefetch",
                 rng_state=None):
        self.loader = loader
        self.describe = describe
        self.free = queue.Queue()
        self.full = queue.Queue()
        for b in batches:
            self.free.put(b)
        self.n_batches = len(batches)
        st = context.get()
        self.gpu = st.mode == context.GPU
        self.device_id = st.device_id
        self.solver_rank = st.solver_rank
        if rng_state is None:  # Caffe's InternalThread: the parent's generator draws the seed
            self.seed = int(context.rng().randint(0, 2 ** 32, dtype=np.uint32))
            rng_state = np.random.RandomState(self.seed).get_state()
        else:
            self.seed = 0
        self.rng_state = rng_state
        self.start_position = _position(loader, rng_state)  # before the first batch
        self.close_loader = True
        self._stop = threading.Event()
        self._failure = None
        self._waits = 0
        self.batches_loaded = 0
        self.host_wait_s = 0.0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    # -- the thread ---------------------------------------------------------------------------
    def start(self):
        self._thread.start()

    def is_alive(self):
        return self._thread.is_alive()

    def join(self, timeout=None):
        """Wait until the thread has ended (after a failure or a stop), at most ``timeout``
        seconds; returns whether it has ended."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self):
        stream = None
        try:
            context.set_random_seed(self.seed)
            context.set_solver_rank(self.solver_rank)
            if self.gpu:
                context.set_device(self.device_id)
                context.set_mode_gpu()
                # kept for the process: what the transform allocates on it is freed on it
                # later, after this thread has ended (context.kept_stream)
                stream = context.kept_stream("prefetch")
            rng = context.rng()
            rng.set_state(self.rng_state)
            while not self._stop.is_set():
                batch = self.free.get()
                if batch is _STOP or self._stop.is_set():
                    break
                if batch.consumed is not None:
                    batch.consumed.synchronize()
                    batch.consumed = None
                if stream is not None:
                    with stream:  # a GPU transform runs on this thread's stream
                        self.loader.load_batch(batch, rng)
                else:
                    self.loader.load_batch(batch, rng)
                batch.position = _position(self.loader, rng.get_state())
                if stream is not None:
                    for b in batch.blobs():
                        if b.data_mem.head == HEAD_AT_CPU:  # not already written there
                            b.data_mem.async_gpu_data(stream)
                    batch.ready = stream.record()
                self.batches_loaded += 1
                self.full.put(batch)
        except BaseException as e:  # handed to the main thread, never lost
            if isinstance(e, MinicaffeError):
                msg = str(e)
            else:
                where = getattr(self.loader, "where", None)
                where = where() if callable(where) else None
                msg = (f"{where}: " if where else "") + \
                    f"the prefetch thread failed: {type(e).__name__}: {e}"
            self.full.put(_Failure(msg, traceback.format_exc()))
        finally:
            close = getattr(self.loader, "close", None) if self.close_loader else None
            if close is not None:
                try:
                    close()
                except Exception:
                    pass

    # -- the consumer side ---------------------------------------------------------------------
    def next_batch(self):
        """The next full batch; raises MinicaffeError if the thread failed or stopped."""
        if self._failure is not None:
            raise MinicaffeError(self._failure.message)
        try:
            item = self.full.get_nowait()
        except queue.Empty:
            self._waits += 1
            if self._waits % 1000 == 1:
                log.info("Waiting for data")
            t0 = time.perf_counter()
            while True:
                try:
                    item = self.full.get(timeout=0.25)
                    break
                except queue.Empty:
                    if not self._thread.is_alive() and self.full.empty():
                        why = "was closed" if self._stop.is_set() else "is not running"
                        raise MinicaffeError(f"the prefetch thread {why}") from None
                    if context.stop_requested():  # a stalled read never makes us deaf
                        raise WaitInterrupted(f"{self.describe}: stopped while waiting "
                                              "for data") from None
            self.host_wait_s += time.perf_counter() - t0
        if isinstance(item, _Failure):
            self._failure = item
            self.stop()
            raise MinicaffeError(item.message)
        return item

    def recycle(self, batch):
        """Hand a consumed batch back to the thread."""
        if self.gpu:
            batch.consumed = backend.current_stream().record()
        self.free.put(batch)

    def batches_back(self):
        """The batches in the queues, once the thread has stopped (to hand to a new one)."""
        out = []
        for q in (self.free, self.full):
            while not q.empty():
                item = q.get_nowait()
                if isinstance(item, Batch):
                    out.append(item)
        return out

    def stop(self, timeout=STOP_TIMEOUT, close_loader=True):
        """Stop the thread and wait for it (not when called from the thread itself); the
        loader is closed unless ``close_loader`` is False (a new thread will use it)."""
        self.close_loader = close_loader
        self._stop.set()
        interrupt = getattr(self.loader, "interrupt", None)
        if interrupt is not None:  # a wait for worker processes ends too
            interrupt()
        self.free.put(_STOP)
        t = self._thread
        if t.is_alive() and t is not threading.current_thread():
            t.join(timeout)
            if t.is_alive():
                log.warning("%s: the prefetch thread did not stop within %.0f s",
                            self.describe, timeout)


def effective_transform_param(layer_param):
    """The layer's TransformationParameter, with the deprecated per-layer fields
    (data_param/image_data_param/window_data_param scale, mean_file, crop_size, mirror)
    folded in where transform_param does not set them."""
    t = caffe_pb2.TransformationParameter()
    t.CopyFrom(layer_param.transform_param)
    for pname in ("data_param", "image_data_param", "window_data_param"):
        if not layer_param.HasField(pname):
            continue
        p = getattr(layer_param, pname)
        for f in ("scale", "mean_file", "crop_size", "mirror"):
            if p.HasField(f) and not t.HasField(f):
                setattr(t, f, getattr(p, f))
    return t


class BaseDataLayer(Layer):
    """A layer with no bottoms whose tops are data (and optionally labels)."""
    graph_prologue = True
    exact_num_bottom_blobs = 0
    min_top_blobs = 1
    max_top_blobs = 2

    def make_transformer(self):
        try:
            return DataTransformer(effective_transform_param(self.layer_param), self.phase)
        except TransformError as e:
            raise self.error(str(e)) from None
        except MinicaffeError as e:  # unreadable mean file
            raise self.error(str(e)) from None

    def reshape(self, bottom, top):
        pass  # tops take the shape of each batch in forward (Caffe's BaseDataLayer)


class BasePrefetchingDataLayer(BaseDataLayer):
    """Subclasses implement ``data_layer_setup(bottom, top) -> loader``: validate the
    source, shape the tops, and return an object with ``load_batch(batch, rng)`` that
    holds everything the thread needs (and no reference to the layer)."""

    measure_wait = True    # GPU mode: time the compute stream's idling for input (events)

    def layer_setup(self, bottom, top):
        self.output_labels = len(top) > 1
        self.transformer = self.make_transformer()
        loader = self.data_layer_setup(bottom, top)
        n = int(self.layer_param.data_param.prefetch)
        if n < 1:
            raise self.error(f"data_param.prefetch must be at least 1, got {n}")
        batches = [Batch(top[0].shape, top[1].shape if self.output_labels else None)
                   for _ in range(n)]
        gpu = context.is_gpu()
        for b in batches:
            for blob in b.blobs():
                if gpu:
                    blob.mutable_gpu_data()
                blob.mutable_cpu_data()  # pinned in GPU mode; head at the CPU
        self._current = None
        self._wait_events = []
        self._gpu_wait_ms = 0.0
        self._loader = loader
        self._start(batches)

    def _start(self, batches, rng_state=None):
        self._prefetch = PrefetchThread(self._loader, batches, f"layer '{self.name}' "
                                        f"({self.type})", name=f"prefetch:{self.name}",
                                        rng_state=rng_state)
        self._position = self._prefetch.start_position
        # The finalizer holds the thread object only, so the layer can be collected.
        self._finalizer = weakref.finalize(self, self._prefetch.stop)
        self._prefetch.start()

    def data_layer_setup(self, bottom, top):
        raise NotImplementedError

    # -- where the net is in the data (exact resume) ------------------------------------------
    def data_position(self):
        """Where the batches this layer has handed to the net end: the loader's position
        (the next record, the shuffled order...) and the generator of its thread, after
        the last batch consumed (the thread may have read further ahead)."""
        return self._position

    def set_data_position(self, position):
        """Continue from ``position`` (from ``data_position``, maybe of another process):
        the thread is stopped, the batches it read ahead are dropped, and a new thread
        reads on from there with the saved generator."""
        self._finalizer.detach()
        self._prefetch.stop(close_loader=False)
        if self._prefetch.is_alive():
            raise self.error("cannot move to the saved data position: the prefetch thread "
                             "does not stop (a stalled read?)")
        batches = self._prefetch.batches_back()
        if self._current is not None:
            if self._prefetch.gpu:  # the net may still read it: the new thread waits
                self._current.consumed = backend.current_stream().record()
            batches.append(self._current)
            self._current = None
        set_position = getattr(self._loader, "set_position", None)
        if set_position is not None:
            try:
                set_position(position)
            except MinicaffeError as e:
                raise self.error(str(e)) from None
        self._start(batches, position["rng"])

    # -- forward --------------------------------------------------------------------------------
    def _next_batch(self):
        if self._current is not None:
            self._prefetch.recycle(self._current)
            self._current = None
        try:
            batch = self._prefetch.next_batch()
        except MinicaffeError as e:
            raise self.error(str(e)) from None
        self._current = batch
        self._position = batch.position
        return batch

    def _hand_over(self, src, top, gpu):
        """Point ``top`` at ``src``'s memory (Caffe's set_cpu_data/set_gpu_data).  The GPU
        step copies it into the top's fixed place after the forward (engine/step.py: a
        replayed CUDA graph reads the tops at fixed addresses)."""
        top.reshape(src.shape)
        if src.data_mem.size < top.data_mem.size:  # the top grew earlier: copy instead
            if gpu:
                top.mutable_gpu_data()[...] = src.gpu_data()
            else:
                top.mutable_cpu_data()[...] = src.cpu_data()
            return
        if gpu:
            top.data_mem.set_gpu_data(src.data_mem.gpu_data())
        else:
            top.data_mem.set_cpu_data(src.data_mem.cpu_data())

    def forward_cpu(self, bottom, top):
        batch = self._next_batch()
        self._hand_over(batch.data, top[0], False)
        if self.output_labels:
            self._hand_over(batch.label, top[1], False)

    def forward_gpu(self, bottom, top):
        stream = backend.current_stream()
        # e0 completes when the GPU has done all the work queued before this batch; e1
        # after the wait for the batch's upload.  Between them the GPU idles only for
        # input: a host late with the batch, or the upload not done.
        e0 = stream.record() if self.measure_wait else None
        batch = self._next_batch()
        if batch.ready is not None:
            stream.wait_event(batch.ready)
        if e0 is not None:
            self._wait_events.append((e0, stream.record()))
            if len(self._wait_events) > 32:
                self._fold_wait_events()
        self._hand_over(batch.data, top[0], True)
        if self.output_labels:
            self._hand_over(batch.label, top[1], True)

    # -- lifecycle and statistics ----------------------------------------------------------------
    def close(self):
        """Stop the prefetch thread (also done when the layer is garbage-collected); a
        layer whose set-up failed before its thread started has none to stop."""
        stop = getattr(self, "_finalizer", None)
        if stop is not None:
            stop()

    @property
    def prefetch_thread(self):
        return self._prefetch

    @property
    def current_batch(self):
        """The batch whose buffers the tops show since the last forward (its ``data`` and
        ``label`` Blobs; the tops share their memory, no copy is made), or None."""
        return self._current

    def _fold_wait_events(self, sync=False):
        """Add the finished event pairs' times to the total (all of them with ``sync``)."""
        if sync and self._wait_events:
            self._wait_events[-1][1].synchronize()
        while self._wait_events and self._wait_events[0][1].done:
            e0, e1 = self._wait_events.pop(0)
            self._gpu_wait_ms += backend.elapsed_ms(e0, e1)

    def data_wait(self):
        """{'batches', 'host_wait_s', 'gpu_wait_ms'}: how long forward waited for the thread
        on the host, and in GPU mode how long the compute stream idled for input (a batch
        late on the host or its upload not done).  Synchronises the recorded events."""
        self._fold_wait_events(sync=True)
        return {"batches": self._prefetch.batches_loaded, "host_wait_s": self._prefetch.host_wait_s,
                "gpu_wait_ms": self._gpu_wait_ms}

    def reset_data_wait(self):
        self._wait_events = []
        self._gpu_wait_ms = 0.0
        self._prefetch.host_wait_s = 0.0
