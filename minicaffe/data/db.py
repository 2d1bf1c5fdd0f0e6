"""Key-value databases of Datum records: LMDB and LevelDB (Caffe's ``db.hpp``).

``open_db(path, backend, mode)`` returns a DB with Caffe's interface:

    db = open_db("examples/mnist/mnist_train_lmdb", "lmdb")      # mode "r"
    cur = db.new_cursor()          # seek_to_first(), next(), valid(), key(), value()
    db.close()

    with open_db("out_lmdb", "lmdb", "new") as db:   # written to a temporary
        txn = db.new_transaction()                    # directory, renamed into place
        txn.put(b"00000000", datum.SerializeToString())   # by close(); removed if an
        txn.commit()                                  # exception escapes the block

LMDB needs the ``lmdb`` package, LevelDB the ``plyvel`` package; both are imported
only when used, and a missing one is a one-line MinicaffeError.  ``backend`` is
"lmdb", "leveldb", a ``DataParameter.DB`` value, or None to detect it from the
files in ``path`` (``data.mdb`` for LMDB, ``CURRENT`` for LevelDB).

Datum helpers: ``array_to_datum``, ``datum_to_array``, ``parse_datum``.
"""
import os
import shutil
import tempfile
import threading

import numpy as np

from ..core import fileio
from ..core.errors import MinicaffeError
from ..proto import caffe_pb2

LMDB = "lmdb"
LEVELDB = "leveldb"
_LMDB_INITIAL_MAP = 1 << 30       # grows by doubling when full (Caffe's DoubleMapSize)


class DBError(MinicaffeError):
    """A database that is missing, unreadable, of the wrong kind, or empty."""


def backend_name(backend):
    """'lmdb' / 'leveldb' from a name or a ``DataParameter.DB`` value."""
    if backend is None:
        return None
    if isinstance(backend, int):
        return LMDB if backend == caffe_pb2.DataParameter.LMDB else LEVELDB
    b = str(backend).lower()
    if b not in (LMDB, LEVELDB):
        raise DBError(f"unknown database backend '{backend}' (use lmdb or leveldb)")
    return b


def detect_backend(path):
    """'lmdb' or 'leveldb' judging by the files in ``path``; None if neither."""
    if os.path.isfile(os.path.join(path, "data.mdb")):
        return LMDB
    if os.path.isfile(os.path.join(path, "CURRENT")):
        return LEVELDB
    return None


def _import_lmdb():
    try:
        import lmdb
    except ImportError:
        raise DBError("reading or writing LMDB needs the 'lmdb' package "
                      "(pip install lmdb, or pip install \".[data]\")") from None
    return lmdb


def _import_plyvel():
    try:
        import plyvel
    except ImportError:
        raise DBError("reading or writing LevelDB needs the 'plyvel' package (pip install "
                      "plyvel); or convert the data to LMDB with backend: LMDB") from None
    return plyvel


def open_db(path, backend=None, mode="r"):
    """Open the database at ``path``.  mode "r" reads an existing one; "new" creates it
    (the path must not exist) through a temporary directory renamed on close."""
    path = os.fspath(path)
    name = backend_name(backend)
    if mode == "r":
        if not os.path.exists(path):
            raise DBError(f"{path}: no such database (the directory does not exist)")
        if not os.path.isdir(path):
            raise DBError(f"{path}: not a database directory (it is a file)")
        found = detect_backend(path)
        if name is None:
            name = found
        if name is None:
            raise DBError(f"{path}: not an LMDB (no data.mdb) nor a LevelDB (no CURRENT file)")
        if found is not None and found != name:
            raise DBError(f"{path}: is a {found.upper()} database but backend {name.upper()} "
                          f"was asked for (set data_param.backend: {found.upper()})")
        if found is None:
            what = "data.mdb" if name == LMDB else "CURRENT"
            raise DBError(f"{path}: not a {name.upper()} database (no {what} inside)")
        return (LMDBDatabase if name == LMDB else LevelDBDatabase)(path, "r")
    if mode == "new":
        name = name or LMDB
        if os.path.exists(path):
            raise DBError(f"{path}: already exists; remove it first or choose another name")
        return (LMDBDatabase if name == LMDB else LevelDBDatabase)(path, "new")
    raise ValueError(f"open_db: mode must be 'r' or 'new', got {mode!r}")


class _Database:
    backend = None

    def __init__(self, path, mode):
        self.path = path
        self.mode = mode
        self.final_path = path
        if mode == "new":
            parent = os.path.dirname(os.path.abspath(path))
            if not os.path.isdir(parent):
                raise DBError(f"{path}: the parent directory {parent} does not exist")
            self.path = tempfile.mkdtemp(prefix="." + os.path.basename(path) + ".tmp-",
                                         dir=parent)
            os.chmod(self.path, fileio.plain_mode(directory=True))  # mkdtemp's is 0700
        self._closed = False

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        else:
            self.abort()
        return False

    def close(self):
        """Close; a new database is then renamed to its final name."""
        if self._closed:
            return
        self._close_handles()
        self._closed = True
        if self.mode == "new":
            os.rename(self.path, self.final_path)
            self.path = self.final_path

    def abort(self):
        """Close and, for a new database, delete what was written."""
        if self._closed:
            return
        self._close_handles()
        self._closed = True
        if self.mode == "new":
            shutil.rmtree(self.path, ignore_errors=True)

    def __iter__(self):
        """(key, value) bytes pairs in key order."""
        cur = self.new_cursor()
        cur.seek_to_first()
        while cur.valid():
            yield cur.key(), cur.value()
            cur.next()

    def count(self):
        n = 0
        for _ in self:
            n += 1
        return n

    def get(self, key):
        raise NotImplementedError


# -- LMDB ------------------------------------------------------------------------------
class LMDBDatabase(_Database):
    """LMDB.  The lmdb package opens an environment once per process, so readers of
    one path (a TRAIN and a TEST net on the same data, several solvers) share it; it
    is closed when the last of them closes."""
    backend = LMDB
    _shared = {}                 # realpath -> [Environment, users]
    _shared_lock = threading.Lock()

    def __init__(self, path, mode):
        super().__init__(path, mode)
        lmdb = _import_lmdb()
        self._lmdb = lmdb
        self._key = None
        try:
            if mode == "r":
                key = os.path.realpath(self.path)
                with self._shared_lock:
                    entry = self._shared.get(key)
                    if entry is None:
                        env = lmdb.open(self.path, readonly=True, lock=False, readahead=False,
                                        meminit=False, max_readers=512)
                        entry = self._shared[key] = [env, 0]
                    entry[1] += 1
                self._key = key
                self.env = entry[0]
            else:
                self.env = lmdb.open(self.path, map_size=_LMDB_INITIAL_MAP, meminit=False,
                                     map_async=True)
        except lmdb.Error as e:
            if mode == "new":
                shutil.rmtree(self.path, ignore_errors=True)
            raise DBError(f"{self.final_path}: cannot open LMDB ({e})") from None

    def _close_handles(self):
        if self._key is None:
            self.env.close()
            return
        with self._shared_lock:
            entry = self._shared[self._key]
            entry[1] -= 1
            if entry[1] == 0:
                del self._shared[self._key]
                entry[0].close()

    def new_cursor(self):
        return LMDBCursor(self)

    def new_transaction(self):
        return LMDBTransaction(self)

    def get(self, key):
        with self.env.begin(buffers=False) as txn:
            return txn.get(key)

    def count(self):
        return self.env.stat()["entries"]


class LMDBCursor:
    """Caffe's Cursor over one long read transaction (safe to use from any one thread)."""

    def __init__(self, db):
        self.db = db
        self.txn = db.env.begin(buffers=False)
        self.cur = self.txn.cursor()
        self._valid = self.cur.first()

    def seek_to_first(self):
        self._valid = self.cur.first()

    def next(self):
        self._valid = self.cur.next()

    def valid(self):
        return self._valid

    def key(self):
        return self.cur.key()

    def value(self):
        return self.cur.value()

    def close(self):
        try:
            self.txn.abort()
        except Exception:
            pass


class LMDBTransaction:
    """Buffers puts and writes them in one transaction on commit, doubling the map
    size whenever LMDB reports it full (Caffe's LMDBTransaction)."""

    def __init__(self, db):
        self.db = db
        self.keys, self.values = [], []

    def put(self, key, value):
        self.keys.append(key if isinstance(key, bytes) else str(key).encode())
        self.values.append(value)

    def commit(self):
        lmdb = self.db._lmdb
        env = self.db.env
        while True:
            try:
                with env.begin(write=True) as txn:
                    for k, v in zip(self.keys, self.values):
                        txn.put(k, v)
                break
            except lmdb.MapFullError:
                env.set_mapsize(env.info()["map_size"] * 2)
        self.keys, self.values = [], []


# -- LevelDB -------------------------------------------------------------------------------
class LevelDBDatabase(_Database):
    backend = LEVELDB

    def __init__(self, path, mode):
        super().__init__(path, mode)
        plyvel = _import_plyvel()
        try:
            if mode == "r":
                self.db = plyvel.DB(self.path, create_if_missing=False)
            else:
                self.db = plyvel.DB(self.path, create_if_missing=True, block_size=65536,
                                    write_buffer_size=268435456, max_open_files=100)
        except plyvel.Error as e:
            if mode == "new":
                shutil.rmtree(self.path, ignore_errors=True)
            raise DBError(f"{self.final_path}: cannot open LevelDB ({e})") from None

    def _close_handles(self):
        self.db.close()

    def new_cursor(self):
        return LevelDBCursor(self)

    def new_transaction(self):
        return LevelDBTransaction(self)

    def get(self, key):
        return self.db.get(key)


class LevelDBCursor:
    def __init__(self, db):
        self.it = db.db.raw_iterator()
        self.it.seek_to_first()

    def seek_to_first(self):
        self.it.seek_to_first()

    def next(self):
        self.it.next()

    def valid(self):
        return self.it.valid()

    def key(self):
        return self.it.key()

    def value(self):
        return self.it.value()

    def close(self):
        self.it.close()


class LevelDBTransaction:
    def __init__(self, db):
        self.db = db
        self.batch = db.db.write_batch()

    def put(self, key, value):
        self.batch.put(key if isinstance(key, bytes) else str(key).encode(), value)

    def commit(self):
        self.batch.write()
        self.batch = self.db.db.write_batch()


# -- Datum helpers -------------------------------------------------------------------------
def array_to_datum(array, label=None):
    """A Datum from a (C, H, W) array: uint8 goes to ``data`` (bytes), anything else to
    ``float_data`` (Caffe's ArrayToDatum / CVMatToDatum)."""
    a = np.asarray(array)
    if a.ndim == 2:
        a = a[None]
    if a.ndim != 3:
        raise ValueError(f"a Datum holds a (channels, height, width) array, got shape {a.shape}")
    d = caffe_pb2.Datum(channels=a.shape[0], height=a.shape[1], width=a.shape[2])
    if a.dtype == np.uint8:
        d.data = np.ascontiguousarray(a).tobytes()
    else:
        d.float_data.extend(np.asarray(a, dtype=np.float32).ravel().tolist())
    if label is not None:
        d.label = int(label)
    return d


def parse_datum(value, where="record"):
    """A Datum from serialized bytes; a DBError naming ``where`` if they do not parse."""
    d = caffe_pb2.Datum()
    try:
        d.ParseFromString(value)
    except Exception as e:
        raise DBError(f"{where}: not a valid Datum ({e})") from None
    return d


def datum_shape(datum):
    return (datum.channels, datum.height, datum.width)


def datum_to_array(datum, where="record", color=None):
    """The (C, H, W) array a Datum holds: uint8 for ``data``, float32 for ``float_data``,
    decoded (BGR, as OpenCV) when ``encoded``; ``color`` True/False forces 3/1 channels
    for encoded images, None keeps the image's own (Caffe's DecodeDatumNative)."""
    if datum.encoded:
        from .images import decode_image
        return decode_image(datum.data, color, where)
    c, h, w = datum_shape(datum)
    n = c * h * w
    if len(datum.data):
        if len(datum.data) != n:
            raise DBError(f"{where}: Datum data holds {len(datum.data)} bytes but its shape "
                          f"{c}x{h}x{w} needs {n}")
        return np.frombuffer(datum.data, dtype=np.uint8).reshape(c, h, w)
    if len(datum.float_data) != n:
        raise DBError(f"{where}: Datum float_data holds {len(datum.float_data)} values but its "
                      f"shape {c}x{h}x{w} needs {n}")
    if n == 0:
        raise DBError(f"{where}: empty Datum (no data, shape {c}x{h}x{w})")
    return np.asarray(datum.float_data, dtype=np.float32).reshape(c, h, w)


def key_text(key):
    """A database key for messages."""
    try:
        return key.decode("ascii")
    except (UnicodeDecodeError, AttributeError):
        return repr(key)
