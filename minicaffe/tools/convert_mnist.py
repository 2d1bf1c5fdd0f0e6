"""Convert MNIST IDX files to a database of Datum records (Caffe's convert_mnist_data).

    python -m minicaffe.tools.convert_mnist IMAGES LABELS DB [--backend lmdb|leveldb]

IMAGES/LABELS are IDX files, gzipped or not (train-images-idx3-ubyte[.gz] ...).
Keys are "%08d"; each Datum is 1x28x28 uint8 with its label.  DB must not exist;
it is written under a temporary name and renamed when complete.
"""
import argparse
import sys

from minicaffe.data import toolutil

PROG = "convert_mnist"


def _main(argv):
    ap = argparse.ArgumentParser(prog="python -m minicaffe.tools.convert_mnist",
                                 description="Convert MNIST IDX files to LMDB/LevelDB.")
    ap.add_argument("images", help="IDX image file (e.g. train-images-idx3-ubyte.gz)")
    ap.add_argument("labels", help="IDX label file (e.g. train-labels-idx1-ubyte.gz)")
    ap.add_argument("db", help="output database directory (must not exist)")
    toolutil.backend_arg(ap)
    args = ap.parse_args(argv)
    from minicaffe.data.convert import convert_mnist
    convert_mnist(args.images, args.labels, args.db, args.backend)


def main(argv=None):
    return toolutil.run(PROG, _main, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
