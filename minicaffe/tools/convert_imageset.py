"""Convert a set of images to a database of Datum records (Caffe's convert_imageset).

    python -m minicaffe.tools.convert_imageset [FLAGS] ROOTFOLDER/ LISTFILE DB_NAME

LISTFILE has lines `subfolder1/file1.JPEG 7` (the label follows the last space).
Each image is read from ROOTFOLDER + path (plain concatenation, as Caffe: end
ROOTFOLDER with a slash).  Keys are "%08d_<path>".  Flags (Caffe's names):
  --gray               read images as grayscale (default false: BGR colour)
  --shuffle            shuffle the lines first
  --backend=lmdb       lmdb or leveldb
  --resize_width=N --resize_height=N   resize (OpenCV bilinear) before storing
  --check_size         check that all raw data have the same size
  --encoded            store the encoded image (PNG/JPEG bytes) instead of pixels
  --encode_type=EXT    re-encode as EXT (png, jpg, ...); implies --encoded
Unreadable images are logged and skipped, as Caffe does.
"""
import argparse
import sys

from minicaffe.core import log
from minicaffe.core.errors import MinicaffeError
from minicaffe.data import toolutil

PROG = "convert_imageset"


def _main(argv):
    ap = argparse.ArgumentParser(prog="python -m minicaffe.tools.convert_imageset",
                                 description="Convert a set of images to LMDB/LevelDB.")
    ap.add_argument("root_folder", help="prefix of every image path (end it with /)")
    ap.add_argument("list_file", help="lines of 'path label'")
    ap.add_argument("db_name", help="output database directory (must not exist)")
    toolutil.add_bool(ap, "gray", "treat images as grayscale ones")
    toolutil.add_bool(ap, "shuffle", "randomly shuffle the order of images and their labels")
    toolutil.backend_arg(ap)
    ap.add_argument("--resize_width", type=int, default=0, help="width images are resized to")
    ap.add_argument("--resize_height", type=int, default=0, help="height images are resized to")
    toolutil.add_bool(ap, "check_size", "check that all the datum have the same size")
    toolutil.add_bool(ap, "encoded", "when true, the encoded image is saved in the datum")
    ap.add_argument("--encode_type", default="", help="optional: what type should we encode the "
                    "image as ('png', 'jpg', ...)")
    args = ap.parse_args(toolutil.gflags_argv(ap, argv))
    if (args.resize_width > 0) != (args.resize_height > 0):
        raise MinicaffeError("--resize_width and --resize_height must be given together")
    from minicaffe.data.convert import convert_imageset
    written, skipped = convert_imageset(
        args.root_folder, args.list_file, args.db_name, gray=args.gray, shuffle=args.shuffle,
        backend=args.backend, resize_height=args.resize_height, resize_width=args.resize_width,
        check_size=args.check_size, encoded=args.encoded, encode_type=args.encode_type)
    if skipped:
        log.warning("%d image(s) could not be read and were skipped", skipped)


def main(argv=None):
    return toolutil.run(PROG, _main, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
