"""A small ImageNet-shaped image folder, generated (no data set ships in a package):
``ROOT/train/<wnid>/<wnid>_<i>.JPEG`` and ``ROOT/val/...``, with Caffe's list files
``ROOT/train.txt`` and ``ROOT/val.txt`` (``<wnid>/<file> <label>`` lines).  The images are
photo-like (smooth colour fields plus grain), 256x256 JPEGs of about 15-20 KiB at
quality 90, so decoding costs what it costs on real photos.

    python examples/imagenet/make_image_folder.py ROOT [--classes 10] [--per_class 100]
        [--val_per_class 10] [--size 256] [--procs N]

The tests, ``benchmarks/input_pipeline.py`` and ``create_imagenet.sh`` use it.
"""
import argparse
import os
import sys
import zlib
from multiprocessing import get_context

import numpy as np


def photo(seed, size=256):
    """One photo-like HxWx3 uint8 RGB image."""
    from PIL import Image
    rs = np.random.RandomState(seed)
    low = rs.randint(0, 256, (6, 6, 3)).astype(np.uint8)
    img = np.asarray(Image.fromarray(low).resize((size, size), Image.BICUBIC), np.float32)
    img += rs.normal(0, 9, img.shape)
    return np.clip(img, 0, 255).astype(np.uint8)


def _write(job):
    path, seed, size = job
    from PIL import Image
    Image.fromarray(photo(seed, size)).save(path, "JPEG", quality=90)
    return os.path.getsize(path)


def make_image_folder(root, classes=10, per_class=100, val_per_class=10, size=256, procs=1):
    """Write the folder and its list files; returns (train list, val list, mean bytes)."""
    jobs, lists = [], {"train": [], "val": []}
    for split, count in (("train", per_class), ("val", val_per_class)):
        for c in range(classes):
            wnid = f"n{c:08d}"
            os.makedirs(os.path.join(root, split, wnid), exist_ok=True)
            for i in range(count):
                name = f"{wnid}/{wnid}_{i}.JPEG"
                jobs.append((os.path.join(root, split, name), zlib.crc32(f"{split}/{name}".encode()),
                             size))
                lists[split].append(f"{name} {c}\n")
    if procs > 1:
        with get_context("spawn").Pool(procs) as pool:
            sizes = pool.map(_write, jobs, chunksize=16)
    else:
        sizes = [_write(j) for j in jobs]
    out = []
    for split in ("train", "val"):
        path = os.path.join(root, f"{split}.txt")
        with open(path, "w") as f:
            f.writelines(lists[split])
        out.append(path)
    return out[0], out[1], float(np.mean(sizes))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("root")
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--per_class", type=int, default=100)
    ap.add_argument("--val_per_class", type=int, default=10)
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--procs", type=int, default=os.cpu_count() or 1)
    a = ap.parse_args(argv)
    train, val, mean = make_image_folder(a.root, a.classes, a.per_class, a.val_per_class,
                                         a.size, a.procs)
    print(f"wrote {train} and {val} (images of {mean / 1024:.1f} KiB on average)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
