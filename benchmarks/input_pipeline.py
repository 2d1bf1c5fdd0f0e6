"""The input pipeline's speed: the Data layer with its worker processes, against PyTorch's
DataLoader with as many workers, and AlexNet trained from LMDBs against the same net on
synthetic input (prints one table; not a test).

    python benchmarks/input_pipeline.py [--images 2000] [--batch 128] [--workers N]
        [--batches 30] [--gpu 0] [--train] [--train_iters 30] [--cpu_nets] [--keep DIR]
        [--gpu_decode]

It generates its own data (examples/imagenet/make_image_folder.py): ``--images``
photo-like 256x256 JPEGs (quality 90), an LMDB of the encoded JPEG Datums
(``convert_imageset --encoded``) and one of raw Datums (BVLC's create_imagenet.sh
default).  AlexNet-style transform: crop 227, mirror, mean_value 104/117/123, TRAIN.

Rows:
- the JPEG decoders alone on one core (simplejpeg when installed, Pillow);
- the Data layer alone (forward after forward, nothing else running: the loader's
  ceiling) from each LMDB with ``--workers`` processes, and with none (the prefetch
  thread alone); in GPU mode (``--gpu``) its batches are transformed on the GPU;
- PyTorch's DataLoader (when torch is installed) on the same JPEG files, with the same
  workers, doing the same work per image (read, decode with Pillow, crop, mirror, mean,
  scale, float32 CHW; pinned and moved to the GPU with ``--gpu``);
- ``--train`` (GPU): AlexNet b``--batch`` (fp32) and ResNet-50 b64 (TF32, the engine's
  fastest) SGD steps from the LMDBs, and from a constant DummyData input (the engine
  alone), in images/s, with the share of the step the compute stream idled for input;
- ``--gpu_decode`` (GPU, needs ``pip install ".[gpu-jpeg]"``): the Data layer alone
  from the JPEG LMDB with the JPEGs decoded on the GPU by nvImageCodec (no workers), and,
  with ``--train``, AlexNet trained from it;
- ``--cpu_nets``: LeNet b64 and CIFAR-10 quick b100 trained on the CPU from LMDBs of
  raw Datums of their shapes: the share of the step spent waiting for data.

The host memory of the workers' ring of batch slots, and the workers' proportional set
size (Linux: their own memory and their share of the ring and the libraries), is printed
with each Data row.
"""
import argparse
import os
import shutil
import sys
import tempfile
import time

import numpy as np

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "examples", "imagenet"))
from minicaffe.core import backend, context, log  # noqa: E402
from minicaffe.bench import cpu_model  # noqa: E402
from minicaffe.core.config import RunConfig  # noqa: E402
from minicaffe.core.blob import Blob  # noqa: E402
from minicaffe.data.convert import convert_imageset  # noqa: E402
from minicaffe.data.images import decode_image, decoder_name  # noqa: E402
from minicaffe.data.workers import default_workers  # noqa: E402
from minicaffe.layers.data_layers import RING_SLOTS  # noqa: E402
from minicaffe.proto import caffe_pb2  # noqa: E402
from minicaffe.compat.testing import make_layer  # noqa: E402
from make_image_folder import make_image_folder  # noqa: E402

MEAN = (104.0, 117.0, 123.0)
TRANSFORM = "crop_size: 227 mirror: true mean_value: 104 mean_value: 117 mean_value: 123"


def sync():
    if context.is_gpu():
        backend.synchronize()


def data_layer(src, batch, workers, gpu_decode=False):
    layer = make_layer(f'name: "data" type: "Data" top: "data" top: "label" '
                       f'data_param {{ source: "{src}" batch_size: {batch} backend: LMDB '
                       f'workers: {workers} }} transform_param {{ {TRANSFORM} }}',
                       caffe_pb2.TRAIN)
    if gpu_decode:
        layer.config = RunConfig.from_environment(gpu_decode=True)
    return layer


def workers_pss_mb():
    """The proportional set size of this process's worker processes, in MB (Linux; None
    elsewhere): their own memory plus their share of the ring and of the libraries."""
    import multiprocessing
    total = 0
    for p in multiprocessing.active_children():
        try:
            with open(f"/proc/{p.pid}/smaps_rollup") as f:
                total += sum(int(l.split()[1]) for l in f if l.startswith("Pss:"))
        except OSError:
            return None
    return total * 1024 / 1e6


def time_layer(src, batch, workers, nbatches, gpu_decode=False):
    """(images/s of the Data layer's forward alone after a warm-up of 3 batches, the workers'
    memory in MB or None); ``gpu_decode``: JPEGs decoded on the GPU (nvImageCodec)."""
    layer = data_layer(src, batch, workers, gpu_decode)
    top = [Blob(), Blob()]
    layer.setup([], top)
    try:
        for _ in range(3):
            layer.forward([], top)
        sync()
        t0 = time.perf_counter()
        for _ in range(nbatches):
            layer.forward([], top)
        sync()
        rate = nbatches * batch / (time.perf_counter() - t0)
        return rate, (workers_pss_mb() if workers else None)
    finally:
        layer.close()


def time_decoders(files, n=200):
    import minicaffe.data.images as images
    out = {}
    datas = [open(f, "rb").read() for f in files[:n]]
    saved = images._simplejpeg
    for name, value in (("simplejpeg", None), ("Pillow", False)):
        images._simplejpeg = value
        if decoder_name() != name:
            continue
        decode_image(datas[0], True)
        t0 = time.perf_counter()
        for d in datas:
            decode_image(d, True)
        out[name] = len(datas) / (time.perf_counter() - t0)
    images._simplejpeg = saved
    return out


class _TorchSet:
    """What the Data layer does per image, as a PyTorch Dataset (Pillow decode); ``uint8``:
    crop and mirror only, the mean and the cast done after the upload (as minicaffe)."""

    def __init__(self, files, labels, uint8=False):
        self.files, self.labels, self.uint8 = files, labels, uint8

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        import torch
        from PIL import Image
        with Image.open(self.files[i]) as im:
            a = np.asarray(im.convert("RGB"))[:, :, ::-1]  # BGR, as Caffe
        rs = np.random
        h0, w0 = rs.randint(0, a.shape[0] - 227 + 1), rs.randint(0, a.shape[1] - 227 + 1)
        a = a[h0:h0 + 227, w0:w0 + 227]
        if rs.randint(2):
            a = a[:, ::-1]
        if self.uint8:
            return torch.from_numpy(np.ascontiguousarray(a.transpose(2, 0, 1))), self.labels[i]
        x = (a.astype(np.float32) - np.asarray(MEAN, np.float32)).transpose(2, 0, 1)
        return torch.from_numpy(np.ascontiguousarray(x)), self.labels[i]


def time_torch(files, labels, batch, workers, nbatches, gpu, uint8=False):
    import torch
    sampler = torch.utils.data.RandomSampler(range(len(files)), replacement=True,
                                             num_samples=batch * (nbatches + 4))
    loader = torch.utils.data.DataLoader(
        _TorchSet(files, labels, uint8), batch_size=batch, sampler=sampler,
        num_workers=workers, pin_memory=gpu is not None, drop_last=True,
        multiprocessing_context="spawn" if workers > 0 else None)
    dev = torch.device(f"cuda:{gpu}") if gpu is not None else None
    mean = torch.tensor(MEAN, dtype=torch.float32).view(1, 3, 1, 1)
    if dev is not None:
        mean = mean.to(dev)
    n, t0, it = 0, None, iter(loader)
    for k in range(nbatches + 3):
        x, y = next(it)
        if dev is not None:
            x = x.to(dev, non_blocking=True)
        if uint8:
            x = x.float() - mean
        if k == 2:
            if dev is not None:
                torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
        elif k > 2:
            n += x.shape[0]
    if dev is not None:
        torch.cuda.synchronize(dev)
    rate = n / (time.perf_counter() - t0)
    del it, loader
    return rate


NETS = {"alexnet": ("models/bvlc_alexnet/train_val.prototxt", 227),
        "resnet50": ("models/resnet50/train_val.prototxt", 224)}


def net_text(name, source, batch):
    """``name``'s train_val (NETS), TRAIN only, reading ``source`` with mean values (None:
    constant DummyData of the same shape)."""
    rel, crop = NETS[name]
    text = open(os.path.join(REPO, rel)).read()
    from minicaffe.core.protoio import parse_text
    net = parse_text(text, caffe_pb2.NetParameter())
    keep = []
    for l in net.layer:
        if any(r.phase == caffe_pb2.TEST for r in l.include):
            continue
        if l.type in ("Accuracy",):
            continue
        if l.type == "Data":
            l.ClearField("include")
            l.data_param.source = source or ""
            l.data_param.batch_size = batch
            l.transform_param.ClearField("mean_file")
            l.transform_param.ClearField("mean_value")
            l.transform_param.mean_value.extend(MEAN)
            if source is None:
                l.type = "DummyData"
                l.ClearField("data_param")
                l.ClearField("transform_param")
                d = l.dummy_data_param
                d.shape.add(dim=[batch, 3, crop, crop])
                d.shape.add(dim=[batch])
                d.data_filler.add(type="constant", value=0.5)
                d.data_filler.add(type="constant", value=1)
        keep.append(l)
    del net.layer[:]
    net.layer.extend(keep)
    from google.protobuf import text_format
    return text_format.MessageToString(net)


def time_train(tmp, name, source, batch, iters, gpu, label, precision="FLOAT",
               gpu_decode=False):
    """(images/s, ms per iteration, compute-stream data wait share) of ``iters`` SGD steps."""
    from minicaffe.solvers import get_solver
    path = os.path.join(tmp, f"{name}_{label}.prototxt")
    with open(path, "w") as f:
        f.write(net_text(name, source, batch))
    sp = caffe_pb2.SolverParameter(net=path, base_lr=0.01, momentum=0.9, lr_policy="fixed",
                                   weight_decay=0.0005, max_iter=100000, display=0,
                                   solver_mode=caffe_pb2.SolverParameter.GPU, device_id=gpu,
                                   random_seed=1, minicaffe_precision=precision)
    s = get_solver(sp, config=RunConfig.from_environment(gpu_decode=gpu_decode))
    try:
        s.step(5)  # graphs captured, queues full
        sync()
        layers = [l for l in s.net.layers if hasattr(l, "data_wait")]
        for l in layers:
            l.reset_data_wait()
        t0 = time.perf_counter()
        s.step(iters)
        sync()
        dt = time.perf_counter() - t0
        waited = sum(l.data_wait()["gpu_wait_ms"] for l in layers) / 1000.0
        return iters * batch / dt, 1000 * dt / iters, (waited / dt if layers else None)
    finally:
        s.close()


def cpu_net_wait(tmp, name, iters):
    """(ms per iteration, data wait share) of LeNet/CIFAR-10 quick on the CPU from an LMDB of
    raw Datums of their shape (random pixels: the wait does not depend on them)."""
    from minicaffe.data.db import array_to_datum, open_db
    from minicaffe.solvers import get_solver
    shape, n, text = {
        "lenet": ((1, 28, 28), 6400, "examples/mnist/lenet_train_test.prototxt"),
        "cifar10_quick": ((3, 32, 32), 5000, "examples/cifar10/cifar10_quick_train_test.prototxt"),
    }[name]
    db_path = os.path.join(tmp, f"{name}_lmdb")
    if not os.path.exists(db_path):
        rs = np.random.RandomState(0)
        with open_db(db_path, "lmdb", "new") as db:
            t = db.new_transaction()
            for i in range(n):
                t.put(b"%08d" % i, array_to_datum(rs.randint(0, 256, shape).astype(np.uint8),
                                                  i % 10).SerializeToString())
            t.commit()
    net_text = open(os.path.join(REPO, text)).read()
    import re
    net_text = re.sub(r'source: "[^"]*"', f'source: "{db_path}"', net_text)
    net_text = re.sub(r'\s*mean_file: "[^"]*"', "", net_text)
    path = os.path.join(tmp, f"{name}.prototxt")
    with open(path, "w") as f:
        f.write(net_text)
    sp = caffe_pb2.SolverParameter(net=path, base_lr=0.001, momentum=0.9, lr_policy="fixed",
                                   max_iter=100000, display=iters, random_seed=1,
                                   solver_mode=caffe_pb2.SolverParameter.CPU)
    s = get_solver(sp)
    try:
        s.step(iters + 1)  # displays at 0 and at iters: the share of the interval between
        t0 = time.perf_counter()
        s.step(iters + 1)
        dt = time.perf_counter() - t0
        return 1000 * dt / (iters + 1), s.data_wait_share
    finally:
        s.close()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--workers", type=int, default=None,
                    help="worker processes (default: minicaffe's default for this machine)")
    ap.add_argument("--batches", type=int, default=30, help="batches timed per loader row")
    ap.add_argument("--gpu", type=int, default=None)
    ap.add_argument("--train", action="store_true", help="AlexNet training rows (GPU)")
    ap.add_argument("--train_iters", type=int, default=30)
    ap.add_argument("--train_nets", default="alexnet,resnet50",
                    help="alexnet (b --batch, fp32), resnet50 (b64, TF32)")
    ap.add_argument("--cpu_nets", action="store_true", help="LeNet/CIFAR-10 quick data wait")
    ap.add_argument("--cpu_iters", type=int, default=200)
    ap.add_argument("--no_torch", action="store_true")
    ap.add_argument("--gpu_decode", action="store_true",
                    help="also decode the JPEG LMDB on the GPU (nvImageCodec; with --gpu)")
    ap.add_argument("--keep", default=None, help="keep the generated data in this folder")
    a = ap.parse_args(argv)
    import logging
    log.logger.setLevel(logging.WARNING)
    workers = a.workers if a.workers is not None else default_workers()
    if a.gpu is not None:
        context.set_device(a.gpu)
        context.set_mode_gpu()
    tmp = a.keep or tempfile.mkdtemp(prefix="minicaffe-input-")
    rows = []
    try:
        t0 = time.perf_counter()
        root = os.path.join(tmp, "imgs")
        if not os.path.exists(os.path.join(root, "train.txt")):
            make_image_folder(root, classes=10, per_class=max(1, a.images // 10), val_per_class=1,
                              size=256, procs=os.cpu_count() or 1)
        with open(os.path.join(root, "train.txt")) as f:
            entries = [line.rsplit(" ", 1) for line in f.read().splitlines() if line]
        files = [os.path.join(root, "train", e[0]) for e in entries]
        labels = [int(e[1]) for e in entries]
        jpeg_kib = np.mean([os.path.getsize(f) for f in files]) / 1024
        dbs = {}
        for kind, enc in (("JPEG", True), ("raw", False)):
            dbs[kind] = os.path.join(tmp, f"{kind}_lmdb")
            if not os.path.exists(dbs[kind]):
                convert_imageset(os.path.join(root, "train") + "/", os.path.join(root, "train.txt"),
                                 dbs[kind], shuffle=True, encoded=enc)
        setup_s = time.perf_counter() - t0

        gpu_name = backend.gpu_name(a.gpu) if a.gpu is not None else None
        print(f"machine: {cpu_model()}, {os.cpu_count()} cores, load average "
              f"{os.getloadavg()[0]:.2f}" + (f"; GPU {a.gpu}: {gpu_name}" if gpu_name else ""))
        print(f"data: {len(files)} generated 256x256 JPEGs of {jpeg_kib:.1f} KiB on average "
              f"(set up in {setup_s:.0f} s); batch {a.batch}; transform {TRANSFORM}; "
              f"JPEG decoder {decoder_name()}; workers {workers}")
        ring_mb = RING_SLOTS * a.batch * 3 * 256 * 256 / 1e6
        for name, rate in time_decoders(files).items():
            rows.append((f"{name} decode alone, one core", "-", f"{rate:,.0f}", ""))
        mode = "GPU" if a.gpu is not None else "CPU"
        for kind in ("JPEG", "raw"):
            for w in (workers, 0):
                rate, pss = time_layer(dbs[kind], a.batch, w,
                                       a.batches if w else max(3, a.batches // 3))
                note = f"transform on the {mode}" + (f"; ring {ring_mb:.0f} MB shared" if w else
                                                     "; prefetch thread alone")
                if pss is not None:
                    note += f"; workers' PSS {pss:.0f} MB in all"
                rows.append((f"Data layer alone, {kind} LMDB", str(w), f"{rate:,.0f}", note))
        if a.gpu_decode and a.gpu is not None:
            rate, _ = time_layer(dbs["JPEG"], a.batch, 0, a.batches, gpu_decode=True)
            rows.append(("Data layer alone, JPEG LMDB, --gpu_decode", "-", f"{rate:,.0f}",
                         "nvImageCodec (nvJPEG) decode and transform on the GPU"))
        if not a.no_torch:
            try:
                import torch  # noqa: F401
            except ImportError:
                torch = None
            if torch is not None:
                for uint8 in (False, True):
                    rate = time_torch(files, labels, a.batch, workers, a.batches, a.gpu, uint8)
                    rows.append(("PyTorch DataLoader, JPEG files", str(workers), f"{rate:,.0f}",
                                 "Pillow decode; " + ("uint8 batches, mean and cast after "
                                                      "the upload" if uint8 else
                                                      "float32 batches")
                                 + ("; pinned, to the GPU" if a.gpu is not None else "")))
        if a.train and a.gpu is not None:
            for name in a.train_nets.split(","):
                batch, prec = (a.batch, "FLOAT") if name == "alexnet" else (64, "TF32")
                title = f"{name} b{batch} {prec.lower()} training"
                synth = time_train(tmp, name, None, batch, a.train_iters, a.gpu, "synthetic", prec)
                rows.append((f"{title}, synthetic input", "-", f"{synth[0]:,.0f}",
                             f"{synth[1]:.2f} ms/iter (the engine alone)"))
                runs = [(k, False) for k in (("JPEG", "raw") if name == "alexnet" else ("JPEG",))]
                if a.gpu_decode:
                    runs.append(("JPEG", True))
                for kind, gdec in runs:
                    r = time_train(tmp, name, dbs[kind], batch, a.train_iters, a.gpu, kind, prec,
                                   gpu_decode=gdec)
                    rows.append((f"{title}, {kind} LMDB" + (", --gpu_decode" if gdec else ""),
                                 "-" if gdec else str(workers), f"{r[0]:,.0f}",
                                 f"{r[1]:.2f} ms/iter, {100 * r[0] / synth[0]:.1f}% of "
                                 f"synthetic; data wait {100 * (r[2] or 0):.1f}%"))
        if a.cpu_nets:
            context.set_mode_cpu()
            for name in ("lenet", "cifar10_quick"):
                ms, share = cpu_net_wait(tmp, name, a.cpu_iters)
                rows.append((f"{name} training on the CPU, raw LMDB", "thread",
                             f"{1000 / ms * (64 if name == 'lenet' else 100):,.0f}",
                             f"{ms:.2f} ms/iter; data wait {100 * share:.1f}%"))
    finally:
        if not a.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    print()
    print("| input | workers | images/s | note |")
    print("|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
