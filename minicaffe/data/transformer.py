"""DataTransformer: Caffe's data_transformer.cpp, vectorised over a batch (numpy), or one
CUDA kernel for CuPy batches (``apply``; kernels/transform.py).

For each image (C, H, W), in Caffe's order:

1. crop a ``crop_size`` square: at a random offset in TRAIN, at the centre in TEST
   (offsets ``Rand(H - crop + 1)``, ``Rand(W - crop + 1)``);
2. subtract the mean: ``mean_file`` (a BlobProto of the *uncropped* image's shape,
   cropped to the same window) or ``mean_value`` (one value, or one per channel);
3. multiply by ``scale``;
4. mirror left-right at random (TRAIN only) -- the mean is subtracted at the
   unmirrored position, as Caffe indexes it.

Caffe draws, per image, ``Rand(2)`` for the mirror first and then the two crop
offsets, each as a raw 32-bit Mersenne Twister output modulo n; the same draws are
made here from the generator passed in (the prefetch thread's own, by default
``context.rng()`` of the calling thread), so a seeded run is reproducible.

Deviation (documented): Caffe also mirrors at random in TEST when a TEST layer sets
``mirror: true``; here mirroring is TRAIN only (the published prototxts never set it
for TEST).

``force_color``/``force_gray`` apply to encoded images only (as Caffe).
"""
import numpy as np

from ..core import context
from ..core.errors import MinicaffeError
from ..proto import caffe_pb2
from .db import datum_to_array

TRAIN = caffe_pb2.TRAIN


def _windows(images, h, w, mirror, hoff, woff, shared=False):
    """(N, C, h, w): image n's (h, w) window at (hoff[n], woff[n]), reversed left-right where
    ``mirror[n]`` (a mirrored window reads the reversed image at W - w - woff).  With
    ``shared`` one image (the mean) serves every n.  One strided gather per batch."""
    from numpy.lib.stride_tricks import sliding_window_view
    n = len(mirror)
    W = images.shape[3]
    idx = np.zeros(n, dtype=np.int64) if shared else np.arange(n)
    out = np.empty((n, images.shape[1], h, w), dtype=images.dtype)
    plain = ~mirror
    if plain.any():
        win = sliding_window_view(images, (h, w), axis=(2, 3))
        out[plain] = win[idx[plain], :, hoff[plain], woff[plain]]
    if mirror.any():
        win = sliding_window_view(images[..., ::-1], (h, w), axis=(2, 3))
        out[mirror] = win[idx[mirror], :, hoff[mirror], (W - w) - woff[mirror]]
    return out


class TransformError(MinicaffeError):
    """A transformation that cannot apply to the data (crop too large, mean of the wrong
    shape, contradictory parameters)."""


def load_mean_file(path):
    """The mean image (C, H, W) float32 from a binaryproto BlobProto."""
    from ..core import protoio
    from ..core.blob import Blob
    proto = protoio.read_binary(path, caffe_pb2.BlobProto())
    shape = Blob.proto_shape(proto)
    n = int(np.prod(shape)) if len(shape) else 0
    data = np.asarray(proto.double_data if len(proto.double_data) else proto.data, dtype=np.float32)
    if n == 0 or data.size != n:
        raise TransformError(f"{path}: not a mean image (BlobProto of shape {tuple(shape)} "
                             f"holding {data.size} values)")
    if len(shape) == 4:
        if shape[0] != 1:
            raise TransformError(f"{path}: a mean file holds one image; this one has num={shape[0]}")
        shape = shape[1:]
    elif len(shape) == 2:
        shape = (1,) + tuple(shape)
    elif len(shape) != 3:
        raise TransformError(f"{path}: a mean image has 3 or 4 axes, this one has shape {tuple(shape)}")
    return data.reshape(shape)


class DataTransformer:
    def __init__(self, param=None, phase=TRAIN, where=""):
        if param is None:
            param = caffe_pb2.TransformationParameter()
        self.param = param
        self.phase = phase
        self.where = where
        self.scale = float(param.scale)
        self.mirror = bool(param.mirror)
        self.crop_size = int(param.crop_size)
        self.force_color = bool(param.force_color)
        self.force_gray = bool(param.force_gray)
        if self.force_color and self.force_gray:
            raise TransformError("cannot set both force_color and force_gray")
        has_mean_file = param.HasField("mean_file")
        if has_mean_file and len(param.mean_value):
            raise TransformError("cannot specify mean_file and mean_value at the same time")
        self.mean = load_mean_file(param.mean_file) if has_mean_file else None
        self.mean_file = param.mean_file if has_mean_file else None
        self.mean_values = np.asarray(param.mean_value, dtype=np.float32) \
            if len(param.mean_value) else None

    # -- shapes and checks ----------------------------------------------------------------
    @property
    def random_crop(self):
        return self.crop_size > 0 and self.phase == TRAIN

    @property
    def random_mirror(self):
        return self.mirror and self.phase == TRAIN

    @property
    def needs_rand(self):
        return self.random_crop or self.random_mirror

    def output_shape(self, in_shape, where=None):
        """(C, h, w) of an image of ``in_shape`` (C, H, W) after transformation; checks that
        the crop fits and the mean matches (a TransformError naming ``where`` otherwise)."""
        where = where or self.where
        c, h, w = in_shape
        pre = f"{where}: " if where else ""
        if c <= 0 or h <= 0 or w <= 0:
            raise TransformError(f"{pre}empty image of shape {c}x{h}x{w}")
        if self.crop_size and (self.crop_size > h or self.crop_size > w):
            raise TransformError(f"{pre}crop_size {self.crop_size} is larger than the image "
                                 f"({h}x{w})")
        if self.mean is not None and self.mean.shape != (c, h, w):
            ms = "x".join(map(str, self.mean.shape))
            raise TransformError(f"{pre}the mean file {self.mean_file} has shape {ms} but the "
                                 f"data is {c}x{h}x{w}; the mean must have the uncropped image's shape")
        if self.mean_values is not None and len(self.mean_values) not in (1, c):
            raise TransformError(f"{pre}specify either 1 mean_value or as many as channels "
                                 f"({c}); got {len(self.mean_values)}")
        if self.crop_size:
            return (c, self.crop_size, self.crop_size)
        return (c, h, w)

    def decode(self, datum, where="record"):
        """The (C, H, W) array of a Datum (encoded ones decoded as force_color/force_gray
        ask, else as stored)."""
        color = True if self.force_color else (False if self.force_gray else None)
        return datum_to_array(datum, where, color)

    # -- the transformation ----------------------------------------------------------------
    def draw(self, n, in_hw, rng=None):
        """Per-image (mirror flags, h offsets, w offsets) for ``n`` images of size ``in_hw``,
        drawn as Caffe draws them."""
        h, w = in_hw
        c = self.crop_size
        k = int(self.random_mirror) + 2 * int(self.random_crop)
        mirror = np.zeros(n, dtype=bool)
        if c:
            hoff = np.full(n, (h - c) // 2, dtype=np.int64)
            woff = np.full(n, (w - c) // 2, dtype=np.int64)
        else:
            hoff = woff = np.zeros(n, dtype=np.int64)
        if k and n:
            rng = rng if rng is not None else context.rng()
            r = rng.randint(0, 2 ** 32, size=(n, k), dtype=np.uint32).astype(np.int64)
            j = 0
            if self.random_mirror:
                mirror = (r[:, 0] % 2).astype(bool)
                j = 1
            if self.random_crop:
                hoff = r[:, j] % (h - c + 1)
                woff = r[:, j + 1] % (w - c + 1)
        return mirror, hoff, woff

    def transform(self, images, out, rng=None, where=None, pool=None):
        """Transform ``images`` (an (N, C, H, W) array, or a list of (C, H, W) arrays of one
        shape; uint8 or float) into ``out`` (N, C, h, w) float array: the random draws first,
        for the whole batch in Caffe's order, then ``apply``.  ``pool`` is accepted for
        compatibility and unused (the transform is vectorised over the batch)."""
        n = len(images)
        if n == 0:
            return out
        if not isinstance(images, np.ndarray):
            images = np.stack(images)
        in_shape = tuple(images.shape[1:])
        oshape = self.output_shape(in_shape, where)
        if tuple(out.shape) != (n,) + oshape:
            raise ValueError(f"transform: out has shape {out.shape}, expected {(n,) + oshape}")
        mirror, hoff, woff = self.draw(n, in_shape[1:], rng)
        return self.apply(images, out, mirror, hoff, woff)

    def apply(self, images, out, mirror, hoff, woff):
        """Caffe's transform of a batch with given draws: ``out[n]`` = (``images[n]``
        cropped at (``hoff[n]``, ``woff[n]``), minus the mean (the file's at the same
        unmirrored window, or the values), times ``scale``), mirrored where ``mirror[n]``.
        numpy arrays: vectorised over the batch; CuPy arrays (uint8 or float32 in, float32
        out): one kernel (kernels/transform.py), bit-identical in fp32."""
        from ..core import backend
        if backend.is_gpu_array(images):
            from ..kernels.transform import transform_batch
            return transform_batch(images, out, mirror, hoff, woff, self.mean,
                                   self.mean_values, self.scale)
        n, c_, H, W = images.shape
        h, w = out.shape[2:]
        mirror = np.asarray(mirror, dtype=bool)
        hoff, woff = np.asarray(hoff, dtype=np.int64), np.asarray(woff, dtype=np.int64)
        cropped = (h, w) != (H, W)
        if cropped or mirror.any():
            src = _windows(images, h, w, mirror, hoff, woff)
        else:
            src = images
        if self.mean is not None:
            m = self.mean if not (cropped or mirror.any()) else \
                _windows(self.mean[None], h, w, mirror, hoff, woff, shared=True)
            np.subtract(src, m, out=out)
        elif self.mean_values is not None:
            mv = self.mean_values
            mv = mv.reshape(1, -1, 1, 1) if len(mv) > 1 else mv[:1].reshape(1, 1, 1, 1)
            np.subtract(src, mv, out=out)
        else:
            out[...] = src
        if self.scale != 1:
            out *= np.asarray(self.scale, dtype=out.dtype)
        return out

    def transform_one(self, image, rng=None, dtype=np.float32):
        """One (C, H, W) image -> a new transformed (C, h, w) array."""
        out = np.empty((1,) + self.output_shape(tuple(image.shape)), dtype=dtype)
        return self.transform([image], out, rng)[0]

    def transform_datums(self, datums, out, rng=None):
        images = [self.decode(d) for d in datums]
        return self.transform(images, out, rng)
