"""Readers (and small writers) for the raw dataset formats Caffe's examples use.

Self-contained: depends only on numpy and the standard library, nothing else
in minicaffe.

MNIST (IDX format, http://yann.lecun.com/exdb/mnist/)
    read_idx(path)             -> ndarray   (gzipped or raw, detected by magic)
    write_idx(path, array)                  (gzipped when path ends in .gz)
    find_mnist_files(root)     -> {name: path} or None
    load_mnist(root)           -> dict(train_images, train_labels,
                                        test_images, test_labels)

CIFAR-10 (https://www.cs.toronto.edu/~kriz/cifar.html)
    read_cifar_binary(path)    -> (images uint8 (N,3,32,32), labels int64 (N,))
    read_cifar_python(path)    -> same, from a python-version pickle batch
    write_cifar_binary(path, images, labels)
    write_cifar_python(path, images, labels)
    find_cifar10_files(root)   -> (format, train_paths, test_path) or None
    extract_cifar10_tarball(tarball, root) -> directory it extracted
    load_cifar10(root)         -> dict(train_images, train_labels,
                                        test_images, test_labels)

Every malformed input raises ValueError("<path>: <what is wrong>").
"""

import gzip
import io
import os
import pickle
import re
import struct
import tarfile
import zlib

import numpy as np

__all__ = [
    "MNIST_FILES", "read_idx", "write_idx", "find_mnist_files", "load_mnist",
    "CIFAR10_URL", "CIFAR10_PYTHON_URL", "CIFAR10_TARBALLS",
    "read_cifar_binary", "read_cifar_python", "write_cifar_binary",
    "write_cifar_python", "find_cifar10_files", "extract_cifar10_tarball",
    "load_cifar10",
]

GZIP_MAGIC = b"\x1f\x8b"

# ----------------------------------------------------------------------------
# IDX
# ----------------------------------------------------------------------------

# IDX type code -> big-endian numpy dtype
_IDX_DTYPES = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
_IDX_CODES = {dt.newbyteorder("=").str[1:]: code for code, dt in _IDX_DTYPES.items()}


def _read_maybe_gzip(path):
    """Whole file content, transparently gunzipped when it starts with 1f 8b."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:2] == GZIP_MAGIC:
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as e:
            # BadGzipFile is an OSError; a truncated stream gives EOFError.
            raise ValueError("%s: corrupt or truncated gzip data (%s)"
                             % (path, str(e) or type(e).__name__)) from None
    return data


def _parse_idx(data, path):
    if len(data) < 4:
        raise ValueError("%s: not an IDX file (only %d bytes, the header needs 4)"
                         % (path, len(data)))
    zero, code, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0:
        raise ValueError("%s: not an IDX file (bad magic number 0x%08x; the first "
                         "two bytes must be zero)" % (path, struct.unpack(">I", data[:4])[0]))
    if code not in _IDX_DTYPES:
        raise ValueError("%s: not an IDX file (unknown data type code 0x%02x)"
                         % (path, code))
    if ndim == 0:
        raise ValueError("%s: bad IDX header (zero dimensions)" % path)
    header = 4 + 4 * ndim
    if len(data) < header:
        raise ValueError("%s: truncated IDX header (%d dimensions need %d bytes, file has %d)"
                         % (path, ndim, header, len(data)))
    dims = struct.unpack(">%dI" % ndim, data[4:header])
    dtype = _IDX_DTYPES[code]
    expected = int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
    actual = len(data) - header
    if actual < expected:
        raise ValueError("%s: truncated IDX data (shape %s of %s needs %d bytes, found %d)"
                         % (path, tuple(dims), dtype.name, expected, actual))
    if actual > expected:
        raise ValueError("%s: IDX data longer than its header says (shape %s of %s "
                         "needs %d bytes, found %d)"
                         % (path, tuple(dims), dtype.name, expected, actual))
    arr = np.frombuffer(data, dtype=dtype, count=expected // dtype.itemsize, offset=header)
    return arr.reshape(dims).astype(dtype.newbyteorder("="))


def read_idx(path):
    """Read an IDX file (gzipped or not) into a numpy array in native byte order.

    MNIST images come back as uint8 (N, 28, 28), labels as uint8 (N,).
    Raises ValueError("<path>: ...") on a corrupt or truncated file.
    """
    path = os.fspath(path)
    return _parse_idx(_read_maybe_gzip(path), path)


def idx_bytes(array):
    """The IDX encoding of `array` (uncompressed)."""
    array = np.asarray(array)
    key = array.dtype.newbyteorder("=").str[1:]
    if key not in _IDX_CODES:
        raise ValueError("IDX cannot store dtype %s (supported: uint8, int8, int16, "
                         "int32, float32, float64)" % array.dtype)
    if array.ndim == 0 or array.ndim > 255:
        raise ValueError("IDX needs 1..255 dimensions, got %d" % array.ndim)
    if any(d > 0xFFFFFFFF for d in array.shape):
        raise ValueError("IDX dimensions must fit in 32 bits, got %s" % (array.shape,))
    code = _IDX_CODES[key]
    head = struct.pack(">HBB", 0, code, array.ndim) + struct.pack(">%dI" % array.ndim, *array.shape)
    return head + np.ascontiguousarray(array, dtype=_IDX_DTYPES[code]).tobytes()


def _atomic_write(path, data):
    tmp = "%s.tmp-%d" % (path, os.getpid())
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_idx(path, array):
    """Write `array` as an IDX file; gzip-compressed when `path` ends in '.gz'."""
    path = os.fspath(path)
    data = idx_bytes(array)
    if path.endswith(".gz"):
        data = gzip.compress(data, compresslevel=6, mtime=0)
    _atomic_write(path, data)
    return path


# ----------------------------------------------------------------------------
# MNIST
# ----------------------------------------------------------------------------

MNIST_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}


def find_mnist_files(root):
    """{key: path} for the four MNIST files in `root` (each as NAME.gz or NAME),
    or None when any is missing. A gzipped file wins over a raw one."""
    found = {}
    for key, name in MNIST_FILES.items():
        for cand in (name + ".gz", name):
            p = os.path.join(root, cand)
            if os.path.isfile(p):
                found[key] = p
                break
        else:
            return None
    return found


def load_mnist(root):
    """Load MNIST from the four standard IDX files (gzipped or not) in `root`.

    Returns dict(train_images uint8 (N,28,28), train_labels uint8 (N,),
    test_images, test_labels)."""
    root = os.fspath(root)
    files = find_mnist_files(root)
    if files is None:
        missing = [n for k, n in MNIST_FILES.items()
                   if not (os.path.isfile(os.path.join(root, n + ".gz"))
                           or os.path.isfile(os.path.join(root, n)))]
        raise FileNotFoundError(
            "MNIST not found in %s: missing %s (each as NAME.gz or NAME). "
            "Get them with `python -m minicaffe.tools.fetch_data mnist %s`."
            % (root, ", ".join(missing), root))
    out = {key: read_idx(p) for key, p in files.items()}
    for split in ("train", "test"):
        imgs, labs = out[split + "_images"], out[split + "_labels"]
        ip, lp = files[split + "_images"], files[split + "_labels"]
        if imgs.ndim != 3 or imgs.dtype != np.uint8:
            raise ValueError("%s: expected uint8 images of shape (N, rows, cols), got %s %s"
                             % (ip, imgs.dtype, imgs.shape))
        if labs.ndim != 1 or labs.dtype != np.uint8:
            raise ValueError("%s: expected uint8 labels of shape (N,), got %s %s"
                             % (lp, labs.dtype, labs.shape))
        if len(imgs) != len(labs):
            raise ValueError("%s: %d labels but %s holds %d images"
                             % (lp, len(labs), os.path.basename(ip), len(imgs)))
        if labs.size and labs.max() > 9:
            raise ValueError("%s: label %d out of range 0..9" % (lp, labs.max()))
    return out


# ----------------------------------------------------------------------------
# CIFAR-10
# ----------------------------------------------------------------------------

CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz"
CIFAR10_PYTHON_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
CIFAR10_TARBALLS = ("cifar-10-binary.tar.gz", "cifar-10-python.tar.gz")
_CIFAR_SHAPE = (3, 32, 32)
_CIFAR_PIXELS = 3 * 32 * 32
_CIFAR_RECORD = 1 + _CIFAR_PIXELS
_CIFAR_BIN_TRAIN = ["data_batch_%d.bin" % i for i in range(1, 6)]
_CIFAR_BIN_TEST = "test_batch.bin"
_CIFAR_PY_TRAIN = ["data_batch_%d" % i for i in range(1, 6)]
_CIFAR_PY_TEST = "test_batch"
_CIFAR_SUBDIRS = {"bin": "cifar-10-batches-bin", "py": "cifar-10-batches-py"}


def _check_cifar_labels(labels, path):
    if labels.size and (labels.min() < 0 or labels.max() > 9):
        bad = labels[(labels < 0) | (labels > 9)][0]
        raise ValueError("%s: label %d out of range 0..9 (not a CIFAR-10 batch?)" % (path, bad))


def read_cifar_binary(path):
    """Read a CIFAR-10 binary batch: records of 1 label byte + 3072 pixel bytes
    (R plane, G plane, B plane, each 32x32 row-major).

    Returns (images uint8 (N,3,32,32), labels int64 (N,))."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        data = f.read()
    if len(data) == 0:
        raise ValueError("%s: empty file (expected records of %d bytes)" % (path, _CIFAR_RECORD))
    if len(data) % _CIFAR_RECORD:
        raise ValueError("%s: size %d is not a multiple of the %d-byte CIFAR-10 record "
                         "(truncated, or not a CIFAR-10 binary batch)"
                         % (path, len(data), _CIFAR_RECORD))
    recs = np.frombuffer(data, dtype=np.uint8).reshape(-1, _CIFAR_RECORD)
    labels = recs[:, 0].astype(np.int64)
    _check_cifar_labels(labels, path)
    images = recs[:, 1:].reshape((-1,) + _CIFAR_SHAPE).copy()
    return images, labels


def write_cifar_binary(path, images, labels):
    """Write images (N,3,32,32) uint8 and labels (N,) as a CIFAR-10 binary batch."""
    path = os.fspath(path)
    images, labels = _check_cifar_arrays(images, labels)
    recs = np.empty((len(images), _CIFAR_RECORD), dtype=np.uint8)
    recs[:, 0] = labels
    recs[:, 1:] = images.reshape(len(images), -1)
    _atomic_write(path, recs.tobytes())
    return path


def _check_cifar_arrays(images, labels):
    images = np.asarray(images)
    labels = np.asarray(labels)
    if images.shape[1:] != _CIFAR_SHAPE or images.ndim != 4:
        raise ValueError("CIFAR-10 images must have shape (N, 3, 32, 32), got %s" % (images.shape,))
    if labels.shape != (len(images),):
        raise ValueError("CIFAR-10 labels must have shape (%d,), got %s" % (len(images), labels.shape))
    if images.dtype != np.uint8:
        if images.size and (images.min() < 0 or images.max() > 255):
            raise ValueError("CIFAR-10 pixel values must be in 0..255")
        images = images.astype(np.uint8)
    if labels.size and (labels.min() < 0 or labels.max() > 9):
        raise ValueError("CIFAR-10 labels must be in 0..9")
    return images, labels.astype(np.uint8)


class _CifarUnpickler(pickle.Unpickler):
    """Unpickler restricted to what a CIFAR batch needs (dicts, lists, strings,
    numpy arrays), so a batch file cannot run arbitrary code."""

    def find_class(self, module, name):
        if name == "_reconstruct" and module in ("numpy.core.multiarray",
                                                 "numpy._core.multiarray"):
            try:
                from numpy._core import multiarray
            except ImportError:  # numpy < 2
                from numpy.core import multiarray
            return multiarray._reconstruct
        if name == "_frombuffer" and module in ("numpy.core.numeric", "numpy._core.numeric"):
            # pickle protocol 5 form of an ndarray
            try:
                from numpy._core import numeric
            except ImportError:  # numpy < 2
                from numpy.core import numeric
            return numeric._frombuffer
        if module == "numpy" and name in ("ndarray", "dtype"):
            return getattr(np, name)
        if module == "_codecs" and name == "encode":
            # Python 3 writes bytes as _codecs.encode(str, 'latin1') under protocol 2
            import _codecs
            return _codecs.encode
        raise pickle.UnpicklingError("refusing to load %s.%s" % (module, name))


def read_cifar_python(path):
    """Read a CIFAR-10 python-version batch (pickled dict with b'data' (N,3072)
    uint8 and b'labels' list). Returns (images uint8 (N,3,32,32), labels int64)."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        raw = f.read()
    try:
        d = _CifarUnpickler(io.BytesIO(raw), encoding="bytes").load()
    except Exception as e:
        raise ValueError("%s: not a CIFAR-10 python batch (unpickling failed: %s)"
                         % (path, str(e) or type(e).__name__)) from None
    if not isinstance(d, dict):
        raise ValueError("%s: not a CIFAR-10 python batch (top-level object is %s, "
                         "expected dict)" % (path, type(d).__name__))

    def get(key):
        for k in (key.encode(), key):
            if k in d:
                return d[k]
        raise ValueError("%s: not a CIFAR-10 python batch (no %r key; keys: %s)"
                         % (path, key, sorted(map(repr, d))))

    data = np.asarray(get("data"))
    labels = np.asarray(get("labels"))
    if data.ndim != 2 or data.shape[1] != _CIFAR_PIXELS:
        raise ValueError("%s: 'data' has shape %s, expected (N, %d)"
                         % (path, data.shape, _CIFAR_PIXELS))
    if labels.shape != (data.shape[0],):
        raise ValueError("%s: %d labels for %d images" % (path, labels.size, data.shape[0]))
    if data.dtype != np.uint8:
        if data.size and (not np.issubdtype(data.dtype, np.integer)
                          or data.min() < 0 or data.max() > 255):
            raise ValueError("%s: 'data' must hold uint8 pixels, got %s" % (path, data.dtype))
        data = data.astype(np.uint8)
    if labels.size and not np.issubdtype(labels.dtype, np.integer):
        raise ValueError("%s: labels must be integers, got %s" % (path, labels.dtype))
    labels = labels.astype(np.int64)
    _check_cifar_labels(labels, path)
    return np.ascontiguousarray(data.reshape((-1,) + _CIFAR_SHAPE)), labels


def write_cifar_python(path, images, labels, batch_label="batch"):
    """Write a CIFAR-10 python-version batch (pickle protocol 2, bytes keys,
    as the official files)."""
    path = os.fspath(path)
    images, labels = _check_cifar_arrays(images, labels)
    d = {b"batch_label": batch_label.encode(),
         b"labels": [int(x) for x in labels],
         b"data": images.reshape(len(images), -1),
         b"filenames": [b"img_%05d.png" % i for i in range(len(images))]}
    _atomic_write(path, pickle.dumps(d, protocol=2))
    return path


def find_cifar10_files(root):
    """Locate CIFAR-10 batches under `root`.

    Looks in root/cifar-10-batches-bin, root/cifar-10-batches-py, then root
    itself (binary names first). Returns (fmt, [train paths], test path) with
    fmt 'bin' or 'py', or None when no complete set is present."""
    root = os.fspath(root)
    layouts = [
        ("bin", os.path.join(root, _CIFAR_SUBDIRS["bin"]), _CIFAR_BIN_TRAIN, _CIFAR_BIN_TEST),
        ("py", os.path.join(root, _CIFAR_SUBDIRS["py"]), _CIFAR_PY_TRAIN, _CIFAR_PY_TEST),
        ("bin", root, _CIFAR_BIN_TRAIN, _CIFAR_BIN_TEST),
        ("py", root, _CIFAR_PY_TRAIN, _CIFAR_PY_TEST),
    ]
    for fmt, d, train, test in layouts:
        paths = [os.path.join(d, n) for n in train + [test]]
        if all(os.path.isfile(p) for p in paths):
            return fmt, paths[:-1], paths[-1]
    return None


def extract_cifar10_tarball(tarball, root):
    """Extract the batch files of a CIFAR-10 tarball (binary or python version)
    into root/cifar-10-batches-{bin,py}/. Only regular files directly inside
    those directories are written (no links, no paths outside root).
    Returns the directory written."""
    tarball, root = os.fspath(tarball), os.fspath(root)
    pat = re.compile(r"^(?:\./)?(cifar-10-batches-(?:bin|py))/([A-Za-z0-9_.\-]+)$")
    written_dir = None
    try:
        with tarfile.open(tarball, "r:*") as tar:
            for m in tar:
                mm = pat.match(m.name)
                if not (mm and m.isfile()) or mm.group(2) in (".", ".."):
                    continue
                sub, name = mm.groups()
                out_dir = os.path.join(root, sub)
                os.makedirs(out_dir, exist_ok=True)
                with tar.extractfile(m) as src:
                    _atomic_write(os.path.join(out_dir, name), src.read())
                written_dir = out_dir
    except (tarfile.TarError, gzip.BadGzipFile, EOFError, zlib.error) as e:
        raise ValueError("%s: corrupt or truncated tarball (%s)"
                         % (tarball, str(e) or type(e).__name__)) from None
    if written_dir is None:
        raise ValueError("%s: no cifar-10-batches-bin/ or cifar-10-batches-py/ files "
                         "inside (not a CIFAR-10 tarball?)" % tarball)
    return written_dir


def cifar10_missing_message(root):
    return (
        "CIFAR-10 not found in {root}. Expected either\n"
        "  {root}/cifar-10-batches-bin/data_batch_1.bin .. data_batch_5.bin, test_batch.bin"
        "  (binary version), or\n"
        "  {root}/cifar-10-batches-py/data_batch_1 .. data_batch_5, test_batch"
        "  (python version),\n"
        "  (the same files directly in {root} are accepted too).\n"
        "Download {url} (or {pyurl}) and place the tarball in {root}; it will be "
        "extracted there automatically. Or run "
        "`python -m minicaffe.tools.fetch_data cifar10 {root}`."
    ).format(root=root, url=CIFAR10_URL, pyurl=CIFAR10_PYTHON_URL)


def load_cifar10(root):
    """Load CIFAR-10 from `root` (binary or python version; see
    find_cifar10_files). A cifar-10-binary.tar.gz / cifar-10-python.tar.gz
    placed in `root` is extracted first when no batches are present.

    Returns dict(train_images uint8 (N,3,32,32), train_labels int64 (N,),
    test_images, test_labels)."""
    root = os.fspath(root)
    found = find_cifar10_files(root)
    if found is None:
        for tb in CIFAR10_TARBALLS:
            p = os.path.join(root, tb)
            if os.path.isfile(p):
                extract_cifar10_tarball(p, root)
                found = find_cifar10_files(root)
                if found is not None:
                    break
    if found is None:
        raise FileNotFoundError(cifar10_missing_message(root))
    fmt, train_paths, test_path = found
    reader = read_cifar_binary if fmt == "bin" else read_cifar_python
    parts = [reader(p) for p in train_paths]
    test_images, test_labels = reader(test_path)
    return {
        "train_images": np.concatenate([p[0] for p in parts]),
        "train_labels": np.concatenate([p[1] for p in parts]),
        "test_images": test_images,
        "test_labels": test_labels,
    }
