#!/usr/bin/env python
"""Prepare CIFAR-10 and train cifar10_quick or cifar10_full with Caffe's schedules.

    python examples/cifar10/train_cifar10.py quick [--gpu 0]   # 4000 + 1000 iterations
    python examples/cifar10/train_cifar10.py full  [--gpu 0]   # 60000 + 5000 + 5000

From the repository root (the prototxts' paths are relative to it, as in Caffe) it does
what data/cifar10/get_cifar10.sh, examples/cifar10/create_cifar10.sh and
train_quick.sh / train_full.sh do:

1. the CIFAR-10 batches in data/cifar10 (``--cifar_dir``): already there, a tarball placed
   there, or a download of the official binary version (``fetch_cifar10``); without
   them it stops with a message naming the files and where to get them;
2. examples/cifar10/cifar10_{train,test}_lmdb and mean.binaryproto (skipped when present);
3. the stages: ``minicaffe train --solver cifar10_quick_solver.prototxt``, then
   ``--solver cifar10_quick_solver_lr1.prototxt --snapshot cifar10_quick_iter_4000.solverstate.h5``
   (and for full, lr1 from iteration 60000 and lr2 from 65000).

``--scale F`` multiplies every stage's max_iter, snapshot, test_interval and test_iter by F (for a
quick check of the whole schedule); other flags (--gpu, --log ...) go to ``minicaffe train``.
"""
import argparse
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

EX = os.path.join("examples", "cifar10")
CIFAR_DIR = os.path.join("data", "cifar10")
TRAIN_DB = os.path.join(EX, "cifar10_train_lmdb")
TEST_DB = os.path.join(EX, "cifar10_test_lmdb")
MEAN = os.path.join(EX, "mean.binaryproto")
SCHEDULES = {
    "quick": ["cifar10_quick_solver.prototxt", "cifar10_quick_solver_lr1.prototxt"],
    "full": ["cifar10_full_solver.prototxt", "cifar10_full_solver_lr1.prototxt",
             "cifar10_full_solver_lr2.prototxt"],
}


class DataMissing(Exception):
    pass


def prepare_data(cifar_dir=CIFAR_DIR, download=True):
    from minicaffe.core import log
    from minicaffe.data.convert import compute_image_mean, convert_cifar, write_mean
    from minicaffe.data.datasets import (CIFAR10_TARBALLS, cifar10_missing_message,
                                         find_cifar10_files)
    have_dbs = all(os.path.isfile(os.path.join(d, "data.mdb")) for d in (TRAIN_DB, TEST_DB))
    if not have_dbs:
        if find_cifar10_files(cifar_dir) is None:
            if download:
                from minicaffe.tools.fetch_data import fetch_cifar10
                try:
                    fetch_cifar10(cifar_dir)
                except FileNotFoundError as e:
                    raise DataMissing(str(e)) from None
            elif not any(os.path.isfile(os.path.join(cifar_dir, t)) for t in CIFAR10_TARBALLS):
                raise DataMissing(cifar10_missing_message(cifar_dir))
        for d in (TRAIN_DB, TEST_DB):  # convert_cifar writes both; never over a partial pair
            if os.path.exists(d):
                import shutil
                shutil.rmtree(d)
        log.info("Creating lmdb...")
        from minicaffe.data.datasets import load_cifar10
        load_cifar10(cifar_dir)  # extracts a tarball placed in cifar_dir, if that is all there is
        convert_cifar(cifar_dir, EX, "lmdb")
    if not os.path.isfile(MEAN):
        log.info("Computing image mean...")
        mean, _ = compute_image_mean(TRAIN_DB)
        write_mean(MEAN, mean)


def scaled_solver(path, scale):
    """A temporary copy of a stage's solver with max_iter, snapshot, test_interval and
    test_iter scaled."""
    from minicaffe.core import protoio
    from minicaffe.proto import caffe_pb2
    p = protoio.read_text(path, caffe_pb2.SolverParameter())
    for f in ("max_iter", "snapshot", "test_interval"):
        setattr(p, f, max(1, int(round(getattr(p, f) * scale))))
    for i, n in enumerate(p.test_iter):
        p.test_iter[i] = max(1, int(round(n * scale)))
    fd, tmp = tempfile.mkstemp(prefix="cifar10_solver_", suffix=".prototxt")
    os.close(fd)
    protoio.write_text(tmp, p)
    return tmp, p


def run_schedule(model, scale, extra):
    from minicaffe import cli
    from minicaffe.core import protoio
    from minicaffe.proto import caffe_pb2
    previous = None
    for solver in SCHEDULES[model]:
        path = os.path.join(EX, solver)
        tmp = None
        if scale != 1:
            tmp, p = scaled_solver(path, scale)
            path = tmp
        else:
            p = protoio.read_text(path, caffe_pb2.SolverParameter())
        args = ["train", "--solver", path] + extra
        if previous is not None:
            args += ["--snapshot", previous]
        try:
            rc = cli.main(args)
        finally:
            if tmp:
                os.remove(tmp)
        if rc:
            return rc
        ext = ".solverstate.h5" if p.snapshot_format == caffe_pb2.SolverParameter.HDF5 \
            else ".solverstate"
        previous = f"{p.snapshot_prefix}_iter_{p.max_iter}{ext}"
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(
        description="Prepare CIFAR-10 and train cifar10_quick/full with Caffe's schedules. "
                    "Other flags (--gpu, --log, ...) go to `minicaffe train`.")
    ap.add_argument("model", choices=sorted(SCHEDULES))
    ap.add_argument("--cifar_dir", default=CIFAR_DIR,
                    help="where the CIFAR-10 batches are or go (default %(default)s)")
    ap.add_argument("--no_download", action="store_true",
                    help="do not try to download CIFAR-10")
    ap.add_argument("--scale", type=float, default=1.0,
                    help="multiply every stage's max_iter/snapshot/test_interval (quick checks)")
    args, rest = ap.parse_known_args(argv)
    os.chdir(ROOT)
    from minicaffe.core import log
    from minicaffe.core.errors import MinicaffeError
    log.init_log()
    try:
        prepare_data(args.cifar_dir, download=not args.no_download)
    except DataMissing as e:
        print(f"train_cifar10: error: {e}", file=sys.stderr)
        return 1
    except (MinicaffeError, ValueError, OSError) as e:
        print(f"train_cifar10: error: {e}", file=sys.stderr)
        return 1
    if args.scale <= 0:
        print("train_cifar10: error: --scale must be positive", file=sys.stderr)
        return 1
    return run_schedule(args.model, args.scale, rest)


if __name__ == "__main__":
    sys.exit(main())
