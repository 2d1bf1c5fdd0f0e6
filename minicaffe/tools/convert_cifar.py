"""Convert CIFAR-10 batches to databases (Caffe's convert_cifar_data).

    python -m minicaffe.tools.convert_cifar INPUT_FOLDER OUTPUT_FOLDER [--backend lmdb|leveldb]

INPUT_FOLDER holds the binary (data_batch_1.bin .. test_batch.bin) or python
(data_batch_1 .. test_batch) version, directly or in cifar-10-batches-bin/ or
cifar-10-batches-py/.  Writes OUTPUT_FOLDER/cifar10_train_lmdb (50000 records) and
cifar10_test_lmdb (10000), keys "%05d", 3x32x32 uint8 Datums (R, G, B planes as
the files store them, like Caffe).
"""
import argparse
import sys

from minicaffe.data import toolutil

PROG = "convert_cifar"


def _main(argv):
    ap = argparse.ArgumentParser(prog="python -m minicaffe.tools.convert_cifar",
                                 description="Convert CIFAR-10 batches to LMDB/LevelDB.")
    ap.add_argument("input_folder")
    ap.add_argument("output_folder")
    ap.add_argument("db_type", nargs="?", choices=("lmdb", "leveldb"),
                    help="as Caffe's third argument (same as --backend)")
    toolutil.backend_arg(ap)
    args = ap.parse_args(argv)
    from minicaffe.data.convert import convert_cifar
    convert_cifar(args.input_folder, args.output_folder, args.db_type or args.backend)


def main(argv=None):
    return toolutil.run(PROG, _main, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
