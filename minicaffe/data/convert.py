"""Dataset conversion to Caffe's databases (the library side of ``minicaffe.tools``).

    convert_mnist(images, labels, db)           convert_mnist_data.cpp: keys "%08d"
    convert_cifar(input_folder, output_folder)  convert_cifar_data.cpp: cifar10_{train,test}_lmdb,
                                                keys "%05d", pixels as stored (R, G, B planes)
    convert_imageset(root, list_file, db, ...)  convert_imageset.cpp: keys "%08d_<path>"
    compute_image_mean(db) / write_mean(path)   compute_image_mean.cpp: a 1xCxHxW BlobProto

Every writer goes through a temporary directory renamed into place at the end, so a
failed or interrupted conversion never leaves a half-written database under the
final name.  Records are committed every 1000 puts, as Caffe's tools do.
"""
import os

import numpy as np

from ..core import context, log, protoio
from ..core.errors import MinicaffeError
from ..proto import caffe_pb2
from .db import array_to_datum, datum_to_array, key_text, open_db, parse_datum
from .images import ImageError, decode_image, encode_image, file_extension, read_image

COMMIT_EVERY = 1000


def write_datums(db_path, records, backend="lmdb", progress=None):
    """Write (key, Datum-or-bytes) pairs into a new database; returns the count."""
    count = 0
    with open_db(db_path, backend, "new") as db:
        txn = db.new_transaction()
        for key, value in records:
            if not isinstance(value, (bytes, bytearray)):
                value = value.SerializeToString()
            txn.put(key if isinstance(key, bytes) else key.encode(), value)
            count += 1
            if count % COMMIT_EVERY == 0:
                txn.commit()
                if progress:
                    progress(count)
        txn.commit()
        if progress and count % COMMIT_EVERY:
            progress(count)
    return count


def _uint8_datum_bytes(images, labels):
    """Serialized Datums for a uint8 (N, C, H, W) array, built in one template."""
    n, c, h, w = images.shape
    d = caffe_pb2.Datum(channels=c, height=h, width=w)
    for i in range(n):
        d.data = images[i].tobytes()
        d.label = int(labels[i])
        yield d.SerializeToString()


# -- MNIST ---------------------------------------------------------------------------------------
def convert_mnist(images_path, labels_path, db_path, backend="lmdb"):
    """IDX images + labels (gzipped or not) -> a database of 1xRxC uint8 Datums."""
    from .datasets import read_idx
    try:
        images = read_idx(images_path)
        labels = read_idx(labels_path)
    except FileNotFoundError as e:
        raise MinicaffeError(f"{e.filename}: no such file") from None
    except ValueError as e:
        raise MinicaffeError(str(e)) from None
    if images.ndim != 3 or images.dtype != np.uint8:
        raise MinicaffeError(f"{images_path}: expected uint8 images (N, rows, cols), got "
                             f"{images.dtype} {images.shape}")
    if labels.ndim != 1:
        raise MinicaffeError(f"{labels_path}: expected labels of shape (N,), got {labels.shape}")
    if len(images) != len(labels):
        raise MinicaffeError(f"{images_path}, {labels_path}: the number of items in the image "
                             f"file ({len(images)}) and the label file ({len(labels)}) must match")
    log.info("A total of %d items.", len(images))
    log.info("Rows: %d Cols: %d", images.shape[1], images.shape[2])
    recs = zip((b"%08d" % i for i in range(len(images))),
               _uint8_datum_bytes(images[:, None], labels))
    return write_datums(db_path, recs, backend)


# -- CIFAR-10 ------------------------------------------------------------------------------------
def convert_cifar(input_folder, output_folder, backend="lmdb"):
    """CIFAR-10 batches (binary or python version) in ``input_folder`` ->
    ``output_folder``/cifar10_train_<backend> and cifar10_test_<backend>.
    Returns (n_train, n_test)."""
    from .datasets import (cifar10_missing_message, find_cifar10_files, read_cifar_binary,
                            read_cifar_python)
    found = find_cifar10_files(input_folder)
    if found is None:
        raise MinicaffeError(cifar10_missing_message(input_folder).splitlines()[0] +
                             " (expected data_batch_1..5[.bin] and test_batch[.bin]; run "
                             f"`python -m minicaffe.tools.fetch_data cifar10 {input_folder}`)")
    fmt, train_paths, test_path = found
    reader = read_cifar_binary if fmt == "bin" else read_cifar_python
    if not os.path.isdir(output_folder):
        os.makedirs(output_folder, exist_ok=True)
    suffix = "lmdb" if backend in ("lmdb", caffe_pb2.DataParameter.LMDB) else "leveldb"

    def read(path):
        try:
            return reader(path)
        except ValueError as e:
            raise MinicaffeError(str(e)) from None

    def train_records():
        idx = 0
        for fileid, path in enumerate(train_paths):
            log.info("Training Batch %d", fileid + 1)
            images, labels = read(path)
            for blob in _uint8_datum_bytes(images, labels):
                yield b"%05d" % idx, blob
                idx += 1

    log.info("Writing Training data")
    n_train = write_datums(os.path.join(output_folder, "cifar10_train_" + suffix),
                           train_records(), backend)
    log.info("Writing Testing data")
    images, labels = read(test_path)
    n_test = write_datums(os.path.join(output_folder, "cifar10_test_" + suffix),
                          zip((b"%05d" % i for i in range(len(images))),
                              _uint8_datum_bytes(images, labels)), backend)
    return n_train, n_test


# -- image sets --------------------------------------------------------------------------------------
def _match_ext(path, encoding):
    ext = file_extension(path)
    en = encoding.lower()
    return ext == en or (en == "jpg" and ext == "jpeg")


def image_to_datum(path, label, height=0, width=0, is_color=True, encoding=""):
    """Caffe's ReadImageToDatum: raw BGR pixels, or (with ``encoding``) the encoded
    image -- the file's own bytes when nothing would change them."""
    img = read_image(path, height, width, is_color)
    if encoding:
        if (img.shape[0] == 3) == bool(is_color) and not height and not width and \
                _match_ext(path, encoding):
            with open(path, "rb") as f:
                data = f.read()
        else:
            data = encode_image(img, encoding)
        return caffe_pb2.Datum(data=data, label=int(label), encoded=True)
    return array_to_datum(img, label)


def convert_imageset(root_folder, list_file, db_path, gray=False, shuffle=False,
                     backend="lmdb", resize_height=0, resize_width=0, check_size=False,
                     encoded=False, encode_type=""):
    """Caffe's convert_imageset: every ``path label`` line of ``list_file`` (image at
    ``root_folder + path``) -> a Datum under key "%08d_<path>".  Unreadable images are
    logged and skipped, as Caffe does.  Returns (written, skipped)."""
    from ..layers.data_layers import read_image_list
    lines = read_image_list(list_file)
    if shuffle:
        log.info("Shuffling data")
        order = context.rng().permutation(len(lines))
        lines = [lines[i] for i in order]
    log.info("A total of %d images.", len(lines))
    if encode_type and not encoded:
        log.info("encode_type specified, assuming encoded=true.")
        encoded = True
    skipped = []
    state = {"size": None}

    def records():
        for line_id, (name, label, n) in enumerate(lines):
            enc = encode_type
            if encoded and not enc:
                enc = file_extension(name)
                if not enc:
                    log.warning("Failed to guess the encoding of '%s'", name)
            try:
                datum = image_to_datum(root_folder + name, label, resize_height, resize_width,
                                       not gray, enc if encoded else "")
            except ImageError as e:
                log.error("Could not open or find file %s (%s:%d: %s)", root_folder + name,
                          list_file, n, e)
                skipped.append(n)
                continue
            if check_size and not datum.encoded:
                size = datum.channels * datum.height * datum.width
                if state["size"] is None:
                    state["size"] = size
                elif len(datum.data) != state["size"]:
                    raise MinicaffeError(f"{list_file}:{n} ({name}): incorrect data field size "
                                         f"{len(datum.data)} (the first image has {state['size']})")
            yield b"%08d_" % line_id + name.encode(), datum

    written = write_datums(db_path, records(), backend,
                           progress=lambda c: log.info("Processed %d files.", c))
    return written, len(skipped)


# -- mean image ----------------------------------------------------------------------------------------
def compute_image_mean(db_path, backend=None):
    """The mean (C, H, W) float32 image of every Datum in a database; returns (mean, count)."""
    db = open_db(db_path, backend)
    try:
        total = None
        shape = None
        count = 0
        log.info("Starting iteration")
        for key, value in db:
            where = f"{db_path}: key {key_text(key)}"
            datum = parse_datum(value, where)
            a = decode_image(datum.data, None, where) if datum.encoded else \
                datum_to_array(datum, where)
            if total is None:
                shape = a.shape
                total = np.zeros(shape, dtype=np.float64)
            elif a.shape != shape:
                raise MinicaffeError(f"{where}: incorrect data field size: shape "
                                     f"{'x'.join(map(str, a.shape))}, the first record has "
                                     f"{'x'.join(map(str, shape))}")
            total += a
            count += 1
            if count % 10000 == 0:
                log.info("Processed %d files.", count)
        if count == 0:
            raise MinicaffeError(f"{db_path}: the database is empty")
        if count % 10000:
            log.info("Processed %d files.", count)
    finally:
        db.close()
    mean = (total / count).astype(np.float32)
    log.info("Number of channels: %d", mean.shape[0])
    for c in range(mean.shape[0]):
        log.info("mean_value channel [%d]: %g", c, float(mean[c].mean()))
    return mean, count


def mean_blob_proto(mean):
    """A BlobProto of a (C, H, W) mean, with Caffe's legacy num/channels/height/width."""
    c, h, w = mean.shape
    p = caffe_pb2.BlobProto(num=1, channels=c, height=h, width=w)
    p.data.extend(np.asarray(mean, dtype=np.float32).ravel().tolist())
    return p


def write_mean(path, mean):
    log.info("Write to %s", path)
    protoio.write_binary(path, mean_blob_proto(mean))
