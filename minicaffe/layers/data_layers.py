"""File-backed data layers: Data (LMDB/LevelDB), ImageData, HDF5Data, HDF5Output, WindowData.

Data and ImageData prefetch on a background thread (``minicaffe.data.prefetch``);
HDF5Data reads synchronously, as Caffe's does.  Every reader can be sharded: with
``context.solver_count()`` N > 1 in TRAIN, solver rank r reads record i only when
i % N == r (record = position in the database, line of the list file, row of each
HDF5 file), so the solvers see disjoint records.  TEST is sharded the same way only while
``context.shard_test()`` is set (multi-GPU training, where every rank tests its own shard);
otherwise it is not (as Caffe: only the root solver tests).

Errors in the data (a missing source, an empty database, a record of another shape,
an undecodable image, a crop larger than the image, a mean of the wrong shape) are one
line naming the layer, the source and the record (key, list-file line or file row).
"""
import os

import numpy as np

from ..core import backend, context, log
from ..core.blob import Blob
from ..data.db import DBError, key_text, open_db, parse_datum
from ..data.images import ImageError, decoder_name, read_image
from ..data.prefetch import BaseDataLayer, BasePrefetchingDataLayer
from ..data.workers import (SlotRing, WorkerFeed, WorkerPool, DBSource, ImageSource,
                            default_workers, mismatch_message, requested_workers)
from ..data.transformer import TransformError
from ..core.errors import MinicaffeError
from .layer import Layer
from ..proto import caffe_pb2
from .registry import register_layer

TRAIN = caffe_pb2.TRAIN
RING_SLOTS = 3   # batches the workers fill ahead of the prefetch thread


def _fmt(shape):
    return "x".join(str(d) for d in shape)


def shard_of(phase, config=None):
    """(count, rank) this reader takes records from (count 1 = all): the run's
    ``config.world_size``/``rank`` (the layer's RunConfig), else this thread's manager."""
    n = config.world_size if config is not None else context.solver_count()
    if n <= 1 or (phase != TRAIN and not context.shard_test()):
        return 1, 0
    return n, (config.rank if config is not None else context.solver_rank())


AUTO_WORKER_BYTES = 1 << 20   # raw batches smaller than this are read in the prefetch thread


def use_gpu_decode(layer, first_bytes, cpu_reason=None):
    """True when this layer decodes its JPEGs on the GPU: the run asks for it
    (``RunConfig.gpu_decode``, ``minicaffe train --gpu_decode``), nvImageCodec imports, the
    mode is GPU and the first record is a JPEG (``first_bytes``).  Asked for without the
    package or in CPU mode: one line (LayerError).  Records that are not JPEGs, or
    ``cpu_reason`` (ImageData's resize), keep the CPU decode with an info line saying why."""
    if not layer.config.gpu_decode:
        return False
    from ..gpu import jpeg
    try:
        jpeg.require()
    except MinicaffeError as e:
        raise layer.error(str(e)) from None
    if not context.is_gpu():
        raise layer.error("--gpu_decode decodes JPEGs on the GPU: it needs GPU mode "
                          "(minicaffe train --gpu N, or solver_mode: GPU)")
    if first_bytes is None or first_bytes[:2] != b"\xff\xd8":
        cpu_reason = "the records are not JPEGs"
    if cpu_reason:
        log.info("layer '%s': --gpu_decode: %s; decoding on the CPU", layer.name, cpu_reason)
        return False
    return True


def choose_workers(layer, batch_size, first, decodes, gpu_decode=False):
    """How many worker processes read this layer's records: $MINICAFFE_DECODE_THREADS
    (``minicaffe train --data_workers``), else ``data_param.workers``, else the default
    (``workers.default_workers``: the cores less two, divided among the solvers), except
    that raw records of under 1 MiB a batch (MNIST, CIFAR-10: the work per batch is less
    than handing it to a process) or with a default of one worker, and batch_size 1
    (records of any shape), are read in the prefetch thread.  0 = in the prefetch thread.  Logs the choice."""
    p = layer.layer_param.data_param
    if gpu_decode:
        log.info("layer '%s': JPEG decoder: nvImageCodec (nvJPEG) on GPU %d, batches of %d "
                 "in the prefetch thread (--gpu_decode)", layer.name, backend.current_device(),
                 batch_size)
        return 0
    if decodes:
        log.info("layer '%s': JPEG decoder: %s", layer.name, decoder_name())
    try:
        n, _ = requested_workers(p.HasField("workers"), p.workers, layer.config)
    except MinicaffeError as e:
        raise layer.error(str(e)) from None
    if batch_size == 1:
        if n:
            log.info("layer '%s': batch_size 1 (records of any shape): reading in the "
                     "prefetch thread", layer.name)
        return 0
    if n is None:
        n = default_workers(layer.config.world_size)
        if not decodes and (batch_size * first.nbytes < AUTO_WORKER_BYTES or n < 2):
            return 0  # raw records: one process gains little over the thread
    return n


def start_feed(layer, n, kind, source, batch_size, first):
    """The worker pool and its ring of batch slots (None for ``n`` = 0)."""
    if n <= 0:
        return None
    dtype = np.uint8 if first.dtype == np.uint8 else np.float32
    ring = SlotRing(RING_SLOTS, batch_size, first.shape, dtype)
    try:
        pool = WorkerPool(n, kind, source, ring, f"layer '{layer.name}' ({layer.type})")
    except MinicaffeError as e:
        ring.close()
        raise layer.error(str(e)) from None
    except BaseException:
        ring.close()
        raise
    log.info("layer '%s': %d data worker process%s, a ring of %d batch slots of %.1f MB "
             "(%.1f MB of shared memory)", layer.name, n, "" if n == 1 else "es", RING_SLOTS,
             ring.slot_bytes / 1e6, ring.nbytes / 1e6)
    return WorkerFeed(pool, ring, pin=context.is_gpu())


def stack_checked(loader, images, wheres, kind):
    """The decoded images of a batch as one (N, C, H, W) array, after Caffe's shape rules:
    one shape in a batch and, unless batch_size is 1, the first record's."""
    err = DBError if kind == "db" else ImageError
    shape0 = images[0].shape
    if loader.batch_size > 1 and shape0 != loader.first_shape:
        raise err(mismatch_message(kind, wheres[0], shape0, loader.first_shape, True))
    for img, w in zip(images, wheres):
        if img.shape != shape0:
            raise err(mismatch_message(kind, w, img.shape, shape0, False))
    return np.stack(images)


class GpuJpegBatch:
    """A batch's encoded images decoded on the GPU (``gpu/jpeg.py``, nvImageCodec) into a
    device (N, C, H, W) uint8 BGR batch.  Records nvImageCodec does not take (not a JPEG,
    CMYK, raw Datums, one it fails to decode) are decoded on the CPU and uploaded into
    their place, so a corrupt record gets the CPU decoder's one-line error.  Caffe's shape
    rules are ``stack_checked``'s.  ``color``: True 3 channels, False 1, None as stored."""

    def __init__(self, layer, color, first_shape, batch_size):
        from ..gpu.jpeg import JpegBatchDecoder
        self.color, self.first_shape, self.batch_size = color, first_shape, batch_size
        try:
            self.decoder = JpegBatchDecoder(backend.current_device())
        except MinicaffeError as e:
            raise layer.error(str(e)) from None
        self.dev = None

    def __call__(self, records, kind):
        """``records``: [(JPEG bytes or None, CPU decode of the record (a callable), where)]
        -> the device batch (valid until the next call)."""
        err = DBError if kind == "db" else ImageError
        host, shapes, parsed = {}, [], {}
        for k, (data, cpu, _) in enumerate(records):
            info = self.decoder.probe(data)
            if info is None:
                host[k] = cpu()
                shapes.append(host[k].shape)
            else:
                c = info[0] if self.color is None else (3 if self.color else 1)
                shapes.append((c,) + info[1:3])
                parsed[k] = info[3]
        shape0 = shapes[0]
        if self.batch_size > 1 and shape0 != self.first_shape:
            raise err(mismatch_message(kind, records[0][2], shape0, self.first_shape, True))
        for s, r in zip(shapes, records):
            if s != shape0:
                raise err(mismatch_message(kind, r[2], s, shape0, False))
        n = len(records)
        if self.dev is None or self.dev.shape != (n,) + shape0:
            self.dev = backend.gpu_module().empty((n,) + shape0, np.uint8)
        stream = backend.current_stream()
        on_gpu = sorted(parsed)
        for j in self.decoder.decode_into([parsed[k] for k in on_gpu], self.dev, on_gpu,
                                          stream):
            k = on_gpu[j]
            host[k] = records[k][1]()  # the CPU decoder decodes it, or says why it cannot
            if host[k].shape != shape0:
                raise err(mismatch_message(kind, records[k][2], host[k].shape, shape0, False))
        for k, img in sorted(host.items()):
            if img.dtype != np.uint8:
                raise err(f"{records[k][2]}: the Datum holds float_data but the first record "
                          "holds encoded images; a database holds one kind")
            self.dev[k].set(np.ascontiguousarray(img), stream=stream)
        return self.dev


class BatchTransform:
    """Transforms a loaded (N, C, H, W) batch into a Batch's data blob, drawing the crop
    offsets and mirror flags first with the prefetch thread's generator (Caffe's order).
    CPU: the vectorised numpy transform.  GPU mode: the raw batch (uint8 for images: a
    quarter of the float bytes) is uploaded on the prefetch thread's stream and one kernel
    writes the blob's device memory; it returns once the upload is done, so the caller
    may reuse ``images``."""

    def __init__(self, transformer):
        self.t = transformer
        self.dev = None

    def __call__(self, batch, images, rng, where):
        n = len(images)
        oshape = self.t.output_shape(tuple(images.shape[1:]), where)
        batch.data.reshape((n,) + oshape)
        mirror, hoff, woff = self.t.draw(n, images.shape[2:], rng)
        if not context.is_gpu():
            self.t.apply(images, batch.data.mutable_cpu_data(), mirror, hoff, woff)
            return
        stream = backend.current_stream()
        if backend.is_gpu_array(images):  # decoded on the GPU (GpuJpegBatch)
            self.t.apply(images, batch.data.mutable_gpu_data(), mirror, hoff, woff)
            stream.synchronize()
            return
        if self.dev is None or self.dev.shape != images.shape or self.dev.dtype != images.dtype:
            self.dev = backend.gpu_module().empty(images.shape, images.dtype)
        stream = backend.current_stream()
        self.dev.set(images, stream=stream)
        self.t.apply(self.dev, batch.data.mutable_gpu_data(), mirror, hoff, woff)
        stream.synchronize()


def _log_output_size(shape):
    s = list(shape) + [1] * (4 - len(shape))
    log.info("output data size: %s", ",".join(str(d) for d in s[:4]) if len(shape) <= 4
             else ",".join(map(str, shape)))


# -- Data: LMDB / LevelDB ----------------------------------------------------------------------
class DBLoader:
    """Reads Datum records from a database cursor, in key order, wrapping around; with a
    WorkerFeed the cursor reads keys only and the workers read, parse and decode."""

    def __init__(self, db, source, batch_size, transformer, output_labels, shard, skip,
                 first_shape, feed=None, gpu_decode=None):
        self.db = db
        self.gpu_decode = gpu_decode  # a GpuJpegBatch (--gpu_decode), or None
        self.source = source
        self.batch_size = batch_size
        self.transformer = transformer
        self.transform = BatchTransform(transformer)
        self.output_labels = output_labels
        self.count, self.rank = shard
        self.skip = skip
        self.first_shape = first_shape
        self.feed = feed
        self.done = None      # with a feed: the position after the last batch handed on
        self.cursor = None
        self.pos = 0
        self.key = None

    def where(self):
        return f"{self.source}: key {key_text(self.key)}" if self.key is not None else self.source

    def _read_position(self):
        return {"record": self.pos if self.cursor is not None else self.skip}

    def position(self):
        """The next record to read (its index in key order)."""
        return dict(self.done) if self.done is not None else self._read_position()

    def set_position(self, position):
        """Read on from ``position`` (the next read reopens the cursor there)."""
        if self.feed is not None:
            self.feed.reset()
        self.done = None
        if self.cursor is not None:
            self.cursor.close()
            self.cursor = None
        self.skip = int(position.get("record", 0))

    def interrupt(self):
        if self.feed is not None:
            self.feed.interrupt()

    def _open(self):
        self.cursor = self.db.new_cursor()
        self.cursor.seek_to_first()
        self.pos = 0
        for _ in range(self.skip):
            self._next()

    def _next(self):
        self.cursor.next()
        self.pos += 1
        if not self.cursor.valid():
            if context.root_solver():
                log.info("Restarting data prefetching from start.")
            self.cursor.seek_to_first()
            self.pos = 0

    def read_keys(self, n):
        """The next ``n`` (key, where) of this shard (the values are not read)."""
        if self.cursor is None:
            self._open()
        out = []
        for _ in range(n):
            self._to_shard()
            key = self.cursor.key()
            out.append((key, f"{self.source}: key {key_text(key)}"))
            self._next()
        return out

    def _to_shard(self):
        """Skip to the next record of this reader's shard (every count-th, from rank)."""
        while self.pos % self.count != self.rank:
            self._next()

    def read(self, n):
        """The next ``n`` (key, Datum) records of this shard."""
        if self.cursor is None:
            self._open()
        out = []
        for _ in range(n):
            self._to_shard()
            self.key = self.cursor.key()
            out.append((self.key, parse_datum(self.cursor.value(), self.where())))
            self._next()
        return out

    def load_batch(self, batch, rng):
        if self.feed is not None:
            slot, items, done = self.feed.next(lambda: self.read_keys(self.batch_size),
                                               self._read_position)
            try:
                self.key = items[0][0]
                ring = self.feed.ring
                self.transform(batch, ring.data(slot), rng, items[0][1])
                if self.output_labels:
                    batch.label.mutable_cpu_data()[...] = ring.labels(slot)
            finally:
                self.feed.release(slot)
            self.done = done
            return
        records = self.read(self.batch_size)
        wheres = [f"{self.source}: key {key_text(k)}" for k, _ in records]
        if self.gpu_decode is not None:
            images = self.gpu_decode(
                [(d.data if d.encoded else None,
                  lambda d=d, w=w: self.transformer.decode(d, w), w)
                 for (_, d), w in zip(records, wheres)], "db")
        else:
            images = stack_checked(self, [self.transformer.decode(d, w)
                                          for (_, d), w in zip(records, wheres)], wheres, "db")
        self.transform(batch, images, rng, wheres[0])
        self.key = records[0][0]
        if self.output_labels:
            batch.label.mutable_cpu_data()[...] = [d.label for _, d in records]

    def close(self):
        if self.feed is not None:
            self.feed.close()
        if self.cursor is not None:
            self.cursor.close()
            self.cursor = None
        try:
            self.db.close()
        except Exception:
            pass


@register_layer("Data")
class DataLayer(BasePrefetchingDataLayer):
    """Datum records from an LMDB or LevelDB (``data_param``: source, backend, batch_size,
    rand_skip, prefetch) -> data (batch, C, H, W) transformed, label (batch,)."""

    def data_layer_setup(self, bottom, top):
        p = self.layer_param.data_param
        if not p.source:
            raise self.error("data_param.source is not set")
        batch_size = int(p.batch_size)
        if batch_size <= 0:
            raise self.error("data_param.batch_size must be specified and positive")
        backend = p.backend if p.HasField("backend") else None
        try:
            db = open_db(p.source, backend)
        except DBError as e:
            raise self.error(str(e)) from None
        try:
            cur = db.new_cursor()
            if not cur.valid():
                raise DBError(f"{p.source}: the database is empty")
            where = f"{p.source}: key {key_text(cur.key())}"
            datum = parse_datum(cur.value(), where)
            cur.close()
            first = self.transformer.decode(datum, where)
            shape = self.transformer.output_shape(first.shape, where)
            shard = shard_of(self.phase, self.config)
            if shard[0] > 1 and db.count() < shard[0]:
                raise DBError(f"{p.source}: {db.count()} records cannot be shared by "
                              f"{shard[0]} solvers")
        except MinicaffeError as e:
            db.close()
            raise self.error(str(e)) from None
        top[0].reshape((batch_size,) + shape)
        _log_output_size(top[0].shape)
        if self.output_labels:
            top[1].reshape((batch_size,))
        skip = 0
        if p.rand_skip:
            skip = int(context.rng().randint(0, 2 ** 32, dtype=np.uint32)) % p.rand_skip
            log.info("Skipping first %d data points.", skip)
        color = True if self.transformer.force_color else \
            (False if self.transformer.force_gray else None)
        try:
            gpu = use_gpu_decode(self, datum.data if datum.encoded else None)
            if gpu:
                gpu = GpuJpegBatch(self, color, tuple(first.shape), batch_size)
            n = choose_workers(self, batch_size, first, bool(datum.encoded), bool(gpu))
            feed = start_feed(self, n, "db", DBSource(p.source, db.backend, color), batch_size,
                              first)
        except BaseException:
            db.close()
            raise
        return DBLoader(db, p.source, batch_size, self.transformer, self.output_labels,
                        shard, skip, tuple(first.shape), feed, gpu or None)


# -- ImageData: a list file of images ----------------------------------------------------------------
def read_image_list(path):
    """[(image path, label, line number)] from a list file of ``path label`` lines (the
    label is after the last space, so paths may contain spaces)."""
    try:
        with open(path, "r") as f:
            text = f.read()
    except FileNotFoundError:
        raise MinicaffeError(f"{path}: no such list file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise MinicaffeError(f"{path}: cannot read the list file ({e})") from None
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        pos = line.rfind(" ")
        if pos < 0:
            raise MinicaffeError(f"{path}:{n}: expected 'image_path label', got '{line}'")
        name, label = line[:pos].rstrip(), line[pos + 1:]
        try:
            out.append((name, int(label), n))
        except ValueError:
            raise MinicaffeError(f"{path}:{n}: the label '{label}' is not an integer") from None
    return out


def _file_bytes(path):
    """The bytes of an image file, or None where it cannot be read (``read_image`` then
    says why, in the layer's words)."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


class ImageListLoader:
    def __init__(self, lines, list_file, root, new_h, new_w, is_color, batch_size,
                 transformer, output_labels, shuffle, shuffle_seed, start, first_shape):
        self.lines = lines
        self.list_file = list_file
        self.root = root
        self.new_h, self.new_w = new_h, new_w
        self.is_color = is_color
        self.batch_size = batch_size
        self.transformer = transformer
        self.transform = BatchTransform(transformer)
        self.output_labels = output_labels
        self.shuffle = shuffle
        self.rng = np.random.RandomState(shuffle_seed)
        self.order = np.arange(len(lines))
        if shuffle:
            self.rng.shuffle(self.order)
        self.pos = start
        self.first_shape = first_shape
        self.current = None
        self.feed = None
        self.gpu_decode = None  # a GpuJpegBatch (--gpu_decode), or None
        self.done = None

    def where(self):
        if self.current is None:
            return self.list_file
        if isinstance(self.current, str):  # the first record of the batch in hand
            return self.current
        name, _, n = self.current
        return f"{self.list_file}:{n} ({name})"

    def _read_position(self):
        out = {"record": self.pos}
        if self.shuffle:
            out.update(order=self.order, shuffle_rng=self.rng.get_state())
        return out

    def position(self):
        """The next entry and, when shuffling, the order and its generator (``order`` is
        replaced, never changed in place, so it needs no copy here)."""
        return dict(self.done) if self.done is not None else self._read_position()

    def set_position(self, position):
        if self.feed is not None:
            self.feed.reset()
        self.done = None
        if "order" in position:
            if len(position["order"]) != len(self.lines):
                raise MinicaffeError(f"{self.list_file}: the saved position is for a list of "
                                     f"{len(position['order'])} images; it now has "
                                     f"{len(self.lines)}")
            self.order = np.asarray(position["order"])
        if "shuffle_rng" in position:
            self.rng.set_state(position["shuffle_rng"])
        self.pos = int(position.get("record", 0)) % len(self.lines)

    def interrupt(self):
        if self.feed is not None:
            self.feed.interrupt()

    def _read(self, entry):
        self.current = entry
        return read_image(self.root + entry[0], self.new_h, self.new_w, self.is_color,
                          where=self.where())

    def read_entries(self, n):
        """The next ``n`` (path, label, where) of the list, reshuffling at each wrap."""
        entries = []
        for _ in range(n):
            entries.append(self.lines[self.order[self.pos]])
            self.pos += 1
            if self.pos >= len(self.lines):
                if context.root_solver():
                    log.info("Restarting data prefetching from start.")
                self.pos = 0
                if self.shuffle:
                    self.order = self.order.copy()  # position() handed out the old one
                    self.rng.shuffle(self.order)
        return [(self.root + name, label, f"{self.list_file}:{n} ({name})")
                for name, label, n in entries]

    def load_batch(self, batch, rng):
        if self.feed is not None:
            slot, items, done = self.feed.next(lambda: self.read_entries(self.batch_size),
                                               self._read_position)
        else:
            items, done = self.read_entries(self.batch_size), None
        self.current = items[0][2]
        try:
            if self.feed is not None:
                images = self.feed.ring.data(slot)
                labels = self.feed.ring.labels(slot)
            elif self.gpu_decode is not None:
                images = self.gpu_decode(
                    [(_file_bytes(path), lambda path=path, w=w: read_image(
                        path, self.new_h, self.new_w, self.is_color, where=w), w)
                     for path, _, w in items], "image")
                labels = [label for _, label, _ in items]
            else:
                images = stack_checked(
                    self, [read_image(path, self.new_h, self.new_w, self.is_color, where=w)
                           for path, _, w in items], [w for _, _, w in items], "image")
                labels = [label for _, label, _ in items]
            self.transform(batch, images, rng, items[0][2])
            if self.output_labels:
                batch.label.mutable_cpu_data()[...] = labels
        finally:
            if self.feed is not None:
                self.feed.release(slot)
        self.done = done

    def close(self):
        if self.feed is not None:
            self.feed.close()


@register_layer("ImageData")
class ImageDataLayer(BasePrefetchingDataLayer):
    """Images named in a list file (``image_data_param``: source, root_folder, batch_size,
    shuffle, new_height/new_width, is_color, rand_skip) -> data (BGR), label."""

    def data_layer_setup(self, bottom, top):
        p = self.layer_param.image_data_param
        new_h, new_w = int(p.new_height), int(p.new_width)
        if (new_h > 0) != (new_w > 0):
            raise self.error("new_height and new_width must be set at the same time")
        if not p.source:
            raise self.error("image_data_param.source is not set")
        batch_size = int(p.batch_size)
        if batch_size <= 0:
            raise self.error("image_data_param.batch_size must be positive")
        try:
            lines = read_image_list(p.source)
        except MinicaffeError as e:
            raise self.error(str(e)) from None
        if not lines:
            raise self.error(f"{p.source}: the list file is empty")
        count, rank = shard_of(self.phase, self.config)
        if count > 1:
            if len(lines) < count:
                raise self.error(f"{p.source}: {len(lines)} images cannot be shared by {count} solvers")
            lines = lines[rank::count]
            log.info("Solver rank %d of %d reads %d of the images", rank, count, len(lines))
        rng = context.rng()
        seed = int(rng.randint(0, 2 ** 32, dtype=np.uint32))
        if p.shuffle:
            log.info("Shuffling data")
        log.info("A total of %d images.", len(lines))
        start = 0
        if p.rand_skip:
            skip = int(rng.randint(0, 2 ** 32, dtype=np.uint32)) % p.rand_skip
            log.info("Skipping first %d data points.", skip)
            if skip >= len(lines):
                raise self.error(f"{p.source}: not enough images ({len(lines)}) to skip {skip}")
            start = skip
        loader = ImageListLoader(lines, p.source, p.root_folder, new_h, new_w, p.is_color,
                                 batch_size, self.transformer, self.output_labels, p.shuffle,
                                 seed, start, None)
        try:
            first = loader._read(lines[loader.order[start]])
            shape = self.transformer.output_shape(first.shape, loader.where())
        except MinicaffeError as e:
            raise self.error(str(e)) from None
        loader.first_shape = tuple(first.shape)
        loader.current = None
        first_path = p.root_folder + lines[loader.order[start]][0]
        gpu = use_gpu_decode(self, _file_bytes(first_path),
                             "new_height/new_width resize on the CPU" if new_h > 0 else None)
        if gpu:
            loader.gpu_decode = GpuJpegBatch(self, bool(p.is_color), tuple(first.shape),
                                             batch_size)
        n = choose_workers(self, batch_size, first, True, gpu)
        loader.feed = start_feed(self, n, "image", ImageSource(new_h, new_w, p.is_color),
                                 batch_size, first)
        top[0].reshape((batch_size,) + shape)
        _log_output_size(top[0].shape)
        if self.output_labels:
            top[1].reshape((batch_size,))
        return loader


# -- HDF5Data / HDF5Output ---------------------------------------------------------------------
def _import_h5py(what):
    try:
        import h5py
    except ImportError:
        raise MinicaffeError(f"{what} needs the 'h5py' package (pip install h5py, or "
                             "pip install \".[data]\")") from None
    return h5py


@register_layer("HDF5Data")
class HDF5DataLayer(BaseDataLayer):
    """Rows of HDF5 datasets named by the tops (``hdf5_data_param``: source = a text file
    listing .h5 files, batch_size, shuffle).  Each top i gets (batch_size,) + the shape of
    one row of dataset ``top[i]``; batches run across file boundaries and wrap around.
    Values are converted to float32 (as Caffe loads them as Dtype)."""
    min_top_blobs = 1
    max_top_blobs = -1

    def layer_setup(self, bottom, top):
        self.h5py = _import_h5py(f"layer '{self.name}' (HDF5Data)")
        p = self.layer_param.hdf5_data_param
        if not p.source:
            raise self.error("hdf5_data_param.source is not set")
        self.batch_size = int(p.batch_size)
        if self.batch_size <= 0:
            raise self.error("hdf5_data_param.batch_size must be positive")
        self.shuffle = p.shuffle
        self.top_names = list(self.layer_param.top)
        log.info("Loading list of HDF5 filenames from: %s", p.source)
        try:
            with open(p.source, "r") as f:
                names = f.read().split()
        except FileNotFoundError:
            raise self.error(f"{p.source}: no such list file") from None
        except (OSError, UnicodeDecodeError) as e:
            raise self.error(f"{p.source}: cannot read the list file ({e})") from None
        if not names:
            raise self.error(f"{p.source}: must list at least 1 HDF5 file")
        base = os.path.dirname(os.path.abspath(p.source))
        self.files = [n if os.path.exists(n) or os.path.isabs(n) else os.path.join(base, n)
                      for n in names]
        log.info("Number of HDF5 files: %d", len(self.files))
        self.source = p.source
        self.shard = shard_of(self.phase, self.config)
        self.rng = np.random.RandomState(int(context.rng().randint(0, 2 ** 32, dtype=np.uint32)))
        self.file_order = np.arange(len(self.files))
        if self.shuffle:
            self.rng.shuffle(self.file_order)
        self.current_file = 0
        self._load(self.file_order[0])
        for i, t in enumerate(top):
            t.reshape((self.batch_size,) + self.data[i].shape[1:])

    def _load(self, index):
        path = self.files[index]
        log.info("Loading HDF5 file: %s", path)
        try:
            with self.h5py.File(path, "r") as f:
                data = []
                for name in self.top_names:
                    if name not in f:
                        raise self.error(f"{path}: failed to find HDF5 dataset '{name}' (datasets: "
                                         f"{', '.join(sorted(f.keys()))})")
                    d = np.asarray(f[name], dtype=np.float32)
                    if d.ndim < 1:
                        raise self.error(f"{path}: dataset '{name}' is a scalar; rows are needed")
                    data.append(d)
        except MinicaffeError:
            raise
        except FileNotFoundError:
            raise self.error(f"{path}: no such HDF5 file (listed in {self.source})") from None
        except OSError as e:
            raise self.error(f"{path}: cannot read HDF5 file ({e})") from None
        n = data[0].shape[0]
        for name, d in zip(self.top_names, data):
            if d.shape[0] != n:
                raise self.error(f"{path}: dataset '{name}' has {d.shape[0]} rows but "
                                 f"'{self.top_names[0]}' has {n}")
        if hasattr(self, "data"):
            for name, d, old in zip(self.top_names, data, self.data):
                if d.shape[1:] != old.shape[1:]:
                    raise self.error(f"{path}: dataset '{name}' rows have shape {d.shape[1:]}, "
                                     f"other files' have {old.shape[1:]}")
        count, rank = self.shard
        rows = np.arange(rank, n, count) if count > 1 else np.arange(n)
        if len(rows) == 0:
            raise self.error(f"{path}: {n} rows cannot be shared by {count} solvers")
        if self.shuffle:
            self.rng.shuffle(rows)
        self.data, self.rows, self.current_row = data, rows, 0
        log.info("Successfully loaded %d rows", n)

    def _next_file(self):
        if len(self.files) > 1:
            self.current_file += 1
            if self.current_file == len(self.files):
                self.current_file = 0
                if self.shuffle:
                    self.rng.shuffle(self.file_order)
                log.info("Looping around to first file.")
            self._load(self.file_order[self.current_file])
        else:
            self.current_row = 0
            if self.shuffle:
                self.rng.shuffle(self.rows)

    def data_position(self):
        """The file being read, the next row, both shuffled orders and their generator."""
        return {"file": self.current_file, "record": self.current_row,
                "order": self.rows.copy(), "file_order": self.file_order.copy(),
                "shuffle_rng": self.rng.get_state()}

    def set_data_position(self, position):
        file_order = np.asarray(position["file_order"])
        if len(file_order) != len(self.files):
            raise self.error(f"{self.source}: the saved position is for a list of "
                             f"{len(file_order)} HDF5 files; it now has {len(self.files)}")
        self.file_order, self.current_file = file_order, int(position["file"])
        self._load(self.file_order[self.current_file])
        if len(position["order"]) != len(self.rows):
            raise self.error(f"{self.files[self.file_order[self.current_file]]}: the saved "
                             f"position is for {len(position['order'])} rows; it now has "
                             f"{len(self.rows)}")
        self.rows, self.current_row = np.asarray(position["order"]), int(position["record"])
        self.rng.set_state(position["shuffle_rng"])

    def forward_cpu(self, bottom, top):
        outs = [t.mutable_cpu_data() for t in top]
        filled = 0
        while filled < self.batch_size:
            take = min(self.batch_size - filled, len(self.rows) - self.current_row)
            idx = self.rows[self.current_row:self.current_row + take]
            for out, d in zip(outs, self.data):
                out[filled:filled + take] = d[idx]
            filled += take
            self.current_row += take
            if self.current_row >= len(self.rows):
                self._next_file()


@register_layer("HDF5Output")
class HDF5OutputLayer(Layer):
    """Appends its two bottoms to datasets 'data' and 'label' of ``hdf5_output_param.file_name``
    at every forward.  The file is written under a temporary name and renamed into place
    when the layer is closed (``close()``, or when it is garbage-collected)."""
    exact_num_bottom_blobs = 2
    exact_num_top_blobs = 0
    names = ("data", "label")

    def layer_setup(self, bottom, top):
        h5py = _import_h5py(f"layer '{self.name}' (HDF5Output)")
        self.file_name = self.layer_param.hdf5_output_param.file_name
        if not self.file_name:
            raise self.error("hdf5_output_param.file_name is not set")
        d = os.path.dirname(os.path.abspath(self.file_name))
        if not os.path.isdir(d):
            raise self.error(f"{self.file_name}: the directory {d} does not exist")
        self.tmp_name = os.path.join(d, f".{os.path.basename(self.file_name)}.tmp-{os.getpid()}")
        try:
            self.file = h5py.File(self.tmp_name, "w")
        except OSError as e:
            raise self.error(f"{self.file_name}: cannot create ({e})") from None
        import weakref
        self._finalizer = weakref.finalize(self, _close_h5, self.file, self.tmp_name,
                                           self.file_name)

    def reshape(self, bottom, top):
        pass

    def forward_cpu(self, bottom, top):
        for name, b in zip(self.names, bottom):
            a = np.asarray(b.cpu_data())
            if name not in self.file:
                self.file.create_dataset(name, data=a, maxshape=(None,) + a.shape[1:],
                                         chunks=True)
            else:
                ds = self.file[name]
                if ds.shape[1:] != a.shape[1:]:
                    raise self.error(f"{self.file_name}: bottom '{name}' changed shape from "
                                     f"{ds.shape[1:]} to {a.shape[1:]} per row")
                n = ds.shape[0]
                ds.resize(n + a.shape[0], axis=0)
                ds[n:] = a
        self.file.flush()

    def close(self):
        """Finish the file and move it to ``file_name``."""
        self._finalizer()


def _close_h5(f, tmp, final):
    try:
        f.close()
        os.replace(tmp, final)
    except Exception as e:  # pragma: no cover - disk full etc.
        log.warning("HDF5Output: could not finish %s (%s)", final, e)


# -- WindowData: R-CNN style windows ------------------------------------------------------------
def read_window_file(path, root_folder=""):
    """Caffe's window file: blocks of ``# image_index / path / channels / height / width /
    num_windows / (class overlap x1 y1 x2 y2) x num_windows``.  Returns
    [(image path, (c, h, w), [(label, overlap, x1, y1, x2, y2), ...])]."""
    try:
        with open(path, "r") as f:
            tokens = f.read().split()
    except FileNotFoundError:
        raise MinicaffeError(f"{path}: failed to open window file (no such file)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise MinicaffeError(f"{path}: failed to open window file ({e})") from None
    if not tokens:
        raise MinicaffeError(f"{path}: the window file is empty")
    images = []
    pos = 0

    def take(n, what):
        nonlocal pos
        if pos + n > len(tokens):
            raise MinicaffeError(f"{path}: image #{len(images)}: the file ends inside {what}")
        out = tokens[pos:pos + n]
        pos += n
        return out

    try:
        while pos < len(tokens):
            tag, index = take(2, "a '# index' header")
            if tag != "#":
                raise MinicaffeError(f"{path}: expected '#' before image #{len(images)}, "
                                     f"got '{tag}'")
            if int(index) != len(images):
                raise MinicaffeError(f"{path}: image index {index} out of order (expected "
                                     f"{len(images)})")
            name, = take(1, "an image path")
            c, h, w, n = (int(x) for x in take(4, "the image size and window count"))
            wins = []
            for _ in range(n):
                lab, ov, x1, y1, x2, y2 = take(6, "a window")
                wins.append((int(lab), float(ov), int(x1), int(y1), int(x2), int(y2)))
            images.append((root_folder + name, (c, h, w), wins))
    except ValueError as e:
        raise MinicaffeError(f"{path}: image #{len(images)}: not a number ({e})") from None
    return images


class WindowLoader:
    def __init__(self, source, images, fg, bg, batch_size, crop_size, mirror, scale,
                 mean, mean_values, context_pad, square, fg_fraction, cache):
        self.source = source
        self.images = images
        self.fg, self.bg = fg, bg
        self.batch_size = batch_size
        self.crop_size = crop_size
        self.mirror = mirror
        self.scale = np.float32(scale)
        self.mean = mean
        self.mean_values = mean_values
        self.context_pad = context_pad
        self.square = square
        self.fg_fraction = fg_fraction
        self.cache = cache
        self.current = None

    def where(self):
        if self.current is None:
            return self.source
        i = self.current
        return f"{self.source}: image #{i} ({self.images[i][0]})"

    def _image(self, index):
        from ..data.images import decode_image
        self.current = index
        if self.cache is not None:
            return decode_image(self.cache[index], True, self.where())
        return read_image(self.images[index][0], 0, 0, True, where=self.where())

    def load_batch(self, batch, rng):
        from ..data.images import resize
        bs, crop = self.batch_size, self.crop_size
        out = batch.data.mutable_cpu_data()
        out[...] = 0
        labels = []
        num_fg = int(np.float32(bs) * np.float32(self.fg_fraction))
        item = 0
        for is_fg, count in ((0, bs - num_fg), (1, num_fg)):
            windows = self.fg if is_fg else self.bg
            for _ in range(count):
                r = int(rng.randint(0, 2 ** 32, dtype=np.uint32))
                img_index, label, x1, y1, x2, y2 = windows[r % len(windows)]
                do_mirror = self.mirror and int(rng.randint(0, 2 ** 32, dtype=np.uint32)) % 2
                img = self._image(img_index)
                ih, iw = img.shape[1:]
                pad_w = pad_h = 0
                size_w = size_h = crop
                if self.context_pad > 0 or self.square:
                    cscale = crop / (crop - 2 * self.context_pad)
                    half_h = (y2 - y1 + 1) / 2.0
                    half_w = (x2 - x1 + 1) / 2.0
                    cx, cy = x1 + half_w, y1 + half_h
                    if self.square:
                        half_h = half_w = max(half_h, half_w)
                    x1 = int(round(cx - half_w * cscale))
                    x2 = int(round(cx + half_w * cscale))
                    y1 = int(round(cy - half_h * cscale))
                    y2 = int(round(cy + half_h * cscale))
                    uh, uw = y2 - y1 + 1, x2 - x1 + 1
                    px1, py1 = max(0, -x1), max(0, -y1)
                    px2, py2 = max(0, x2 - iw + 1), max(0, y2 - ih + 1)
                    x1, x2, y1, y2 = x1 + px1, x2 - px2, y1 + py1, y2 - py2
                    sx, sy = crop / uw, crop / uh
                    size_w = int(round((x2 - x1 + 1) * sx))
                    size_h = int(round((y2 - y1 + 1) * sy))
                    px1, px2 = int(round(px1 * sx)), int(round(px2 * sx))
                    py1 = int(round(py1 * sy))
                    pad_h = py1
                    pad_w = px2 if do_mirror else px1
                    size_h = min(size_h, crop - pad_h)
                    size_w = min(size_w, crop - pad_w)
                if not (0 <= x1 <= x2 < iw and 0 <= y1 <= y2 < ih):
                    raise MinicaffeError(f"{self.where()}: window ({x1}, {y1}, {x2}, {y2}) is "
                                         f"outside the {iw}x{ih} image")
                win = resize(np.ascontiguousarray(img[:, y1:y2 + 1, x1:x2 + 1]), size_h, size_w)
                if do_mirror:
                    win = win[:, :, ::-1]
                o = out[item, :, pad_h:pad_h + size_h, pad_w:pad_w + size_w]
                if self.mean is not None:
                    off = (self.mean.shape[2] - crop) // 2
                    m = self.mean[:, off + pad_h:off + pad_h + size_h, off + pad_w:off + pad_w + size_w]
                    np.subtract(win, m, out=o)
                elif self.mean_values is not None:
                    np.subtract(win, self.mean_values.reshape(-1, 1, 1), out=o)
                else:
                    o[...] = win
                o *= self.scale
                labels.append(label)
                item += 1
        batch.label.mutable_cpu_data()[...] = labels


@register_layer("WindowData")
class WindowDataLayer(BasePrefetchingDataLayer):
    """Windows of images for R-CNN style training (``window_data_param``: source (a window
    file), batch_size, fg_threshold, bg_threshold, fg_fraction, context_pad, crop_mode
    "warp" or "square", cache_images, root_folder, scale; ``transform_param``: crop_size
    (required), mirror, mean_file or mean_value).  Each batch holds batch_size*(1-fg_fraction)
    background windows (overlap < bg_threshold, label 0) then foreground windows (overlap >=
    fg_threshold), sampled at random, warped to crop_size (with context_pad pixels of
    context), as Caffe's window_data_layer.cpp."""
    exact_num_top_blobs = 2
    min_top_blobs = max_top_blobs = -1

    def data_layer_setup(self, bottom, top):
        p = self.layer_param.window_data_param
        t = self.transformer
        if not p.source:
            raise self.error("window_data_param.source is not set")
        crop = t.crop_size
        if crop <= 0:
            raise self.error("transform_param.crop_size must be positive for WindowData")
        if p.crop_mode not in ("warp", "square"):
            raise self.error(f"crop_mode must be 'warp' or 'square', got '{p.crop_mode}'")
        if 2 * p.context_pad >= crop:
            raise self.error(f"context_pad {p.context_pad} leaves nothing of a {crop} crop")
        batch_size = int(p.batch_size)
        if batch_size <= 0:
            raise self.error("window_data_param.batch_size must be positive")
        log.info("Window data layer: foreground (object) overlap threshold: %g; background "
                 "(non-object) overlap threshold: %g; foreground sampling fraction: %g; "
                 "cache_images: %s; root_folder: %s", p.fg_threshold, p.bg_threshold,
                 p.fg_fraction, p.cache_images, p.root_folder)
        try:
            images = read_window_file(p.source, p.root_folder)
        except MinicaffeError as e:
            raise self.error(str(e)) from None
        fg, bg = [], []
        hist = {0: 0}
        for i, (_, _, wins) in enumerate(images):
            for lab, ov, x1, y1, x2, y2 in wins:
                if ov >= p.fg_threshold:
                    if lab <= 0:
                        raise self.error(f"{p.source}: image #{i}: foreground window with "
                                         f"label {lab} (must be > 0)")
                    fg.append((i, lab, x1, y1, x2, y2))
                    hist[lab] = hist.get(lab, 0) + 1
                elif ov < p.bg_threshold:
                    bg.append((i, 0, x1, y1, x2, y2))
                    hist[0] += 1
        log.info("Number of images: %d", len(images))
        for k in sorted(hist):
            log.info("class %d has %d samples", k, hist[k])
        log.info("Amount of context padding: %d", p.context_pad)
        log.info("Crop mode: %s", p.crop_mode)
        num_fg = int(np.float32(batch_size) * np.float32(p.fg_fraction))
        if num_fg and not fg:
            raise self.error(f"{p.source}: no foreground windows (overlap >= {p.fg_threshold})")
        if batch_size - num_fg and not bg:
            raise self.error(f"{p.source}: no background windows (overlap < {p.bg_threshold})")
        channels = images[0][1][0]
        if channels != 3:
            raise self.error(f"{p.source}: image #0 has {channels} channels; WindowData reads "
                             "colour images (3)")
        mean = None
        if t.mean is not None:
            if t.mean.shape[0] != channels or t.mean.shape[1] != t.mean.shape[2] or \
                    t.mean.shape[1] < crop:
                raise self.error(f"the mean file {t.mean_file} has shape "
                                 f"{_fmt(t.mean.shape)}; WindowData needs a square mean of "
                                 f"{channels} channels at least {crop} wide")
            mean = t.mean
        mv = None
        if t.mean_values is not None:
            if len(t.mean_values) not in (1, channels):
                raise self.error(f"specify either 1 mean_value or as many as channels: {channels}")
            mv = np.broadcast_to(t.mean_values, (channels,)).astype(np.float32) \
                if len(t.mean_values) == 1 else t.mean_values
        cache = None
        if p.cache_images:
            cache = []
            for i, (path, _, _) in enumerate(images):
                try:
                    with open(path, "rb") as f:
                        cache.append(f.read())
                except OSError as e:
                    raise self.error(f"{p.source}: image #{i}: cannot read {path} ({e})") from None
        top[0].reshape((batch_size, channels, crop, crop))
        _log_output_size(top[0].shape)
        top[1].reshape((batch_size,))
        return WindowLoader(p.source, images, fg, bg, batch_size, crop, t.mirror, p.scale, mean,
                            mv, p.context_pad, p.crop_mode == "square", p.fg_fraction, cache)
