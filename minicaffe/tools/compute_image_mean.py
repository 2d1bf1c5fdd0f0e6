"""Compute the mean image of a database (Caffe's compute_image_mean).

    python -m minicaffe.tools.compute_image_mean INPUT_DB [OUTPUT_FILE] [--backend lmdb|leveldb]

Writes the mean as a 1xCxHxW BlobProto (``mean.binaryproto``), the file a
``transform_param { mean_file: ... }`` reads, and logs each channel's mean value.
Encoded images are decoded as stored (BGR).  The backend is detected from the
files when --backend is not given.
"""
import argparse
import sys

from minicaffe.data import toolutil

PROG = "compute_image_mean"


def _main(argv):
    ap = argparse.ArgumentParser(prog="python -m minicaffe.tools.compute_image_mean",
                                 description="Compute the mean image of an LMDB/LevelDB.")
    ap.add_argument("input_db")
    ap.add_argument("output_file", nargs="?", help="where to write the mean BlobProto")
    ap.add_argument("--backend", default=None, choices=("lmdb", "leveldb"),
                    help="the database type (default: detect)")
    args = ap.parse_args(argv)
    from minicaffe.data.convert import compute_image_mean, write_mean
    mean, _ = compute_image_mean(args.input_db, args.backend)
    if args.output_file:
        write_mean(args.output_file, mean)


def main(argv=None):
    return toolutil.run(PROG, _main, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
