"""Reader + transformer throughput of the data layers (CPU; prints figures, not a test).

    python benchmarks/data_throughput.py [--mnist DIR] [--jpegs 300] [--batches 200]

1. MNIST from LMDB (60,000 1x28x28 Datums, scale 1/256, batch 64):
   a. the loader alone on the calling thread (read + parse + transform);
   b. the Data layer's forward, fed by its prefetch thread (what a net sees when the
      rest of the iteration takes no time).
2. ImageNet-style: N 256x256 JPEGs (generated, quality 90), stored encoded in an LMDB by
   convert_imageset --encoded; TRAIN transform crop_size 227, mirror, mean_value
   104/117/123, batch 50:
   a. the loader alone; b. the Data layer's forward; c. ImageData reading the files.
MNIST is read from --mnist (IDX files) when given or found in ../shared/data/mnist,
otherwise random images of the same shape are used.
"""
import argparse
import os
import shutil
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from minicaffe.core import context  # noqa: E402
from minicaffe.bench import cpu_model as cpu_name  # noqa: E402
from minicaffe.core.blob import Blob  # noqa: E402
from minicaffe.data.convert import convert_imageset, convert_mnist, write_datums  # noqa: E402
from minicaffe.data.prefetch import Batch  # noqa: E402
from minicaffe.compat.testing import make_layer  # noqa: E402


def mnist_db(tmp, mnist_dir):
    path = os.path.join(tmp, "mnist_train_lmdb")
    if mnist_dir:
        convert_mnist(os.path.join(mnist_dir, "train-images-idx3-ubyte.gz"),
                      os.path.join(mnist_dir, "train-labels-idx1-ubyte.gz"), path)
        return path, "MNIST train set"
    from minicaffe.proto import caffe_pb2
    rng = np.random.RandomState(0)
    imgs = rng.randint(0, 256, (60000, 28, 28)).astype(np.uint8)

    def recs():
        d = caffe_pb2.Datum(channels=1, height=28, width=28)
        for i in range(len(imgs)):
            d.data = imgs[i].tobytes()
            d.label = i % 10
            yield b"%08d" % i, d.SerializeToString()
    write_datums(path, recs())
    return path, "random 1x28x28 stand-in (no MNIST found)"


def jpeg_set(tmp, n):
    from PIL import Image
    root = os.path.join(tmp, "jpegs")
    os.makedirs(root)
    rng = np.random.RandomState(1)
    lines = []
    sizes = 0
    for i in range(n):
        # smooth colour fields plus texture: compresses like a photograph
        low = rng.randint(0, 256, (9, 9, 3)).astype(np.uint8)
        img = Image.fromarray(low).resize((256, 256), Image.BICUBIC)
        a = np.asarray(img).astype(np.int16) + rng.randint(-12, 13, (256, 256, 3))
        name = f"img{i:05d}.jpg"
        Image.fromarray(np.clip(a, 0, 255).astype(np.uint8)).save(os.path.join(root, name),
                                                                  quality=90)
        sizes += os.path.getsize(os.path.join(root, name))
        lines.append(f"{name} {i % 1000}\n")
    with open(os.path.join(tmp, "list.txt"), "w") as f:
        f.writelines(lines)
    db = os.path.join(tmp, "jpeg_lmdb")
    convert_imageset(root + "/", os.path.join(tmp, "list.txt"), db, encoded=True)
    return root, os.path.join(tmp, "list.txt"), db, sizes / n


def time_loader(src, batch, transform, nbatches):
    """The Data layer's loader alone (read + parse + decode + transform), on this thread."""
    from minicaffe.data.db import open_db, parse_datum
    from minicaffe.data.transformer import DataTransformer
    from minicaffe.layers.data_layers import DBLoader
    from minicaffe.proto import caffe_pb2
    from minicaffe.core.protoio import parse_text
    tp = parse_text(transform, caffe_pb2.TransformationParameter())
    t = DataTransformer(tp, caffe_pb2.TRAIN)
    db = open_db(src)
    cur = db.new_cursor()
    first = t.decode(parse_datum(cur.value()))
    cur.close()
    loader = DBLoader(db, src, batch, t, True, (1, 0), 0, tuple(first.shape))
    b = Batch((batch,) + t.output_shape(first.shape), (batch,))
    rng = np.random.RandomState(0)
    loader.load_batch(b, rng)  # warm up
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(nbatches):
        loader.load_batch(b, rng)
    dt, dcpu = time.perf_counter() - start, time.process_time() - cpu
    loader.close()
    return rates(nbatches * batch, dt, dcpu)


def rates(n, wall, cpu):
    """'N images/s (M per CPU-second)': the second figure is what the process got done
    per second of CPU time (all its threads), which moves less with the machine's load."""
    return f"{n / wall:,.0f} images/s ({n / cpu:,.0f} per CPU-second)"


def time_forward(layer, nbatches):
    top = [Blob(), Blob()]
    layer.setup([], top)
    for _ in range(3):
        layer.forward([], top)
    t, cpu = time.perf_counter(), time.process_time()
    for _ in range(nbatches):
        layer.forward([], top)
    dt, dcpu = time.perf_counter() - t, time.process_time() - cpu
    return rates(nbatches * top[0].shape[0], dt, dcpu), layer


def data_layer(src, batch, transform):
    return make_layer(f'name: "d" type: "Data" top: "data" top: "label" '
                      f'data_param {{ source: "{src}" batch_size: {batch} backend: LMDB }} '
                      f'transform_param {{ {transform} }}', context_phase())


def context_phase():
    from minicaffe.proto import caffe_pb2
    return caffe_pb2.TRAIN


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mnist", default=None)
    ap.add_argument("--jpegs", type=int, default=300)
    ap.add_argument("--batches", type=int, default=200, help="MNIST batches to time")
    ap.add_argument("--jpeg_batches", type=int, default=24, help="JPEG batches to time")
    a = ap.parse_args()
    shared = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared",
                          "data", "mnist")
    mnist_dir = a.mnist or (shared if os.path.isdir(shared) else None)
    context.set_random_seed(1)
    print(f"machine: {cpu_name()}, {os.cpu_count()} cores; numpy {np.__version__}; "
          f"load average {os.getloadavg()[0]:.2f}; data workers (default) "
          f"{__import__('minicaffe.data.workers', fromlist=['x']).default_workers()}")
    tmp = tempfile.mkdtemp(prefix="minicaffe-bench-")
    try:
        db, what = mnist_db(tmp, mnist_dir)
        mn = "scale: 0.00390625"
        ips = time_loader(db, 64, mn, a.batches)
        print(f"MNIST LMDB ({what}), batch 64, scale: loader alone {ips}")
        ips, layer = time_forward(data_layer(db, 64, mn), a.batches)
        layer.close()
        print(f"MNIST LMDB, batch 64: Data layer forward (prefetch thread) {ips}")

        root, lst, jdb, avg = jpeg_set(tmp, a.jpegs)
        tf = "crop_size: 227 mirror: true mean_value: 104 mean_value: 117 mean_value: 123"
        ips = time_loader(jdb, 50, tf, a.jpeg_batches)
        print(f"{a.jpegs} encoded 256x256 JPEGs (avg {avg / 1024:.1f} KiB) in LMDB, batch 50, "
              f"227x227 random crop + mirror + mean: loader alone {ips}")
        ips, layer = time_forward(data_layer(jdb, 50, tf), a.jpeg_batches)
        layer.close()
        print(f"same, Data layer forward (prefetch thread) {ips}")
        il = make_layer(f'name: "i" type: "ImageData" top: "data" top: "label" '
                        f'image_data_param {{ source: "{lst}" root_folder: "{root}/" '
                        f'batch_size: 50 }} transform_param {{ {tf} }}', context_phase())
        ips, il = time_forward(il, a.jpeg_batches)
        il.close()
        print(f"same, ImageData layer forward from the JPEG files {ips}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
