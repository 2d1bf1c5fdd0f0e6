"""Files written whole or not at all (snapshots, weights, converted databases).

``with atomic_path(path) as tmp:`` hands out a temporary name in ``path``'s folder
(``.tmp-<name>-XXXXXX``); when the block ends the file is renamed to ``path``, and when
it fails the temporary file is removed, so a crash or a full disk never leaves a
truncated ``path``.  The file gets the mode a plain ``open(path, "w")`` would give
(``plain_mode``: 0666 less the umask; ``mkstemp`` alone gives 0600), and a failed write
(a full disk, a folder that went away) is one line naming ``path``.  A write killed
outright (kill -9) leaves its ``.tmp-`` file: ``remove_leftovers`` clears those.
"""
import contextlib
import glob
import os
import tempfile

from .errors import MinicaffeError

TMP_PREFIX = ".tmp-"


def plain_mode(directory=False):
    """The mode ``open()`` (0666) or ``mkdir()`` (0777) gives under this process's umask."""
    mask = os.umask(0)
    os.umask(mask)
    return (0o777 if directory else 0o666) & ~mask


def write_error(path, e):
    """A failed write of ``path`` as one line naming it."""
    return MinicaffeError(f"{path}: cannot write ({e.strerror or e})")


@contextlib.contextmanager
def atomic_path(path):
    """A temporary name next to ``path`` (an empty file of plain mode), renamed to ``path``
    when the block ends and removed if it fails."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX + os.path.basename(path) + "-", dir=folder)
        try:
            os.fchmod(fd, plain_mode())
        finally:
            os.close(fd)
    except OSError as e:
        raise write_error(path, e) from None
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError) and not isinstance(e, MinicaffeError):
            raise write_error(path, e) from None
        raise


def remove_leftovers(prefix):
    """Remove the temporary files that killed writes of files named ``prefix...`` left."""
    folder, base = os.path.split(os.path.abspath(prefix))
    for f in glob.glob(os.path.join(glob.escape(folder), glob.escape(TMP_PREFIX + base) + "*")):
        with contextlib.suppress(OSError):
            os.unlink(f)
