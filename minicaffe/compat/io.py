"""pycaffe's io module (python/caffe/io.py): BlobProto/Datum <-> arrays, image loading,
resizing, oversampling, and the Transformer that prepares images for a Net.

Needs only numpy (and Pillow for ``load_image``).  ``resize_image`` is our own bilinear
(``interp_order=1``) or nearest (``0``) resampling with pixel-centre alignment and edge
clamping, the mapping skimage's ``resize`` uses.
"""
import numpy as np

from ..core.errors import MinicaffeError
from ..proto import caffe_pb2


# -- proto / datum / ndarray conversion ------------------------------------------------------
def blobproto_to_array(blob, return_diff=False):
    """The data (or diff) of a BlobProto as an array of the blob's shape (the legacy
    num/channels/height/width when those are set)."""
    data = blob.diff if return_diff else blob.data
    if blob.HasField("num") or blob.HasField("channels") or blob.HasField("height") or \
            blob.HasField("width"):
        return np.array(data).reshape(blob.num, blob.channels, blob.height, blob.width)
    return np.array(data).reshape(tuple(blob.shape.dim))


def array_to_blobproto(arr, diff=None):
    """A BlobProto with ``shape`` and float data (and diff, if given) from an N-d array."""
    arr = np.asarray(arr)
    blob = caffe_pb2.BlobProto()
    blob.shape.dim.extend(arr.shape)
    blob.data.extend(arr.astype(float).flat)
    if diff is not None:
        blob.diff.extend(np.asarray(diff).astype(float).flat)
    return blob


def arraylist_to_blobprotovector_str(arraylist):
    """A serialized BlobProtoVector of the arrays."""
    vec = caffe_pb2.BlobProtoVector()
    vec.blobs.extend([array_to_blobproto(arr) for arr in arraylist])
    return vec.SerializeToString()


def blobprotovector_str_to_arraylist(s):
    """The arrays of a serialized BlobProtoVector."""
    vec = caffe_pb2.BlobProtoVector()
    vec.ParseFromString(s)
    return [blobproto_to_array(blob) for blob in vec.blobs]


def array_to_datum(arr, label=None):
    """A Datum from a (channels, height, width) array: uint8 arrays go in ``data`` as
    bytes, other dtypes in ``float_data``."""
    arr = np.asarray(arr)
    if arr.ndim != 3:
        raise ValueError("Incorrect array shape.")
    datum = caffe_pb2.Datum()
    datum.channels, datum.height, datum.width = arr.shape
    if arr.dtype == np.uint8:
        datum.data = arr.tobytes()
    else:
        datum.float_data.extend(arr.astype(float).flat)
    if label is not None:
        datum.label = label
    return datum


def datum_to_array(datum):
    """The (channels, height, width) array of a Datum (uint8 from ``data``, float from
    ``float_data``); the label is ``datum.label``.  Encoded (JPEG/PNG) datums are decoded."""
    shape = (datum.channels, datum.height, datum.width)
    if datum.encoded:
        return _decode_datum(datum)
    if len(datum.data):
        return np.frombuffer(datum.data, dtype=np.uint8).reshape(shape)
    return np.array(datum.float_data).astype(float).reshape(shape)


def _decode_datum(datum):
    import io as _pyio
    from PIL import Image
    img = np.asarray(Image.open(_pyio.BytesIO(datum.data)))
    if img.ndim == 2:
        img = img[:, :, np.newaxis]
    else:
        img = img[:, :, ::-1]  # Caffe stores BGR (OpenCV's order)
    return np.ascontiguousarray(img.transpose(2, 0, 1))


# -- pre-processing -----------------------------------------------------------------------------
class Transformer:
    """Prepare inputs for a Net: ``Transformer({'data': net.blobs['data'].data.shape})``.

    ``preprocess(in_, data)`` takes an H' x W' x K image and, in this order: converts to
    float32, resizes to the input's H x W, transposes (``set_transpose``), reorders
    channels (``set_channel_swap``), multiplies by ``raw_scale``, subtracts ``mean``,
    multiplies by ``input_scale``.  ``deprocess`` undoes it in reverse order."""

    def __init__(self, inputs):
        self.inputs = inputs
        self.transpose = {}
        self.channel_swap = {}
        self.raw_scale = {}
        self.mean = {}
        self.input_scale = {}

    def __check_input(self, in_):
        if in_ not in self.inputs:
            raise Exception(f"{in_} is not one of the net inputs: {self.inputs}")

    def preprocess(self, in_, data):
        self.__check_input(in_)
        caffe_in = np.asarray(data).astype(np.float32, copy=False)
        transpose = self.transpose.get(in_)
        channel_swap = self.channel_swap.get(in_)
        raw_scale = self.raw_scale.get(in_)
        mean = self.mean.get(in_)
        input_scale = self.input_scale.get(in_)
        in_dims = tuple(self.inputs[in_][2:])
        if caffe_in.shape[:2] != in_dims:
            caffe_in = resize_image(caffe_in, in_dims)
        if transpose is not None:
            caffe_in = caffe_in.transpose(transpose)
        if channel_swap is not None:
            caffe_in = caffe_in[list(channel_swap), :, :]
        if raw_scale is not None:
            caffe_in = caffe_in * raw_scale
        if mean is not None:
            caffe_in = caffe_in - mean
        if input_scale is not None:
            caffe_in = caffe_in * input_scale
        return caffe_in.astype(np.float32, copy=False)

    def deprocess(self, in_, data):
        """Invert ``preprocess`` (except the resize)."""
        self.__check_input(in_)
        decaf_in = np.array(data, copy=True).squeeze()
        transpose = self.transpose.get(in_)
        channel_swap = self.channel_swap.get(in_)
        raw_scale = self.raw_scale.get(in_)
        mean = self.mean.get(in_)
        input_scale = self.input_scale.get(in_)
        if input_scale is not None:
            decaf_in = decaf_in / input_scale
        if mean is not None:
            decaf_in = decaf_in + mean
        if raw_scale is not None:
            decaf_in = decaf_in / raw_scale
        if channel_swap is not None:
            decaf_in = decaf_in[np.argsort(channel_swap), :, :]
        if transpose is not None:
            decaf_in = decaf_in.transpose(np.argsort(transpose))
        return decaf_in

    def set_transpose(self, in_, order):
        """The order to transpose an input's axes (``(2, 0, 1)``: HxWxK -> KxHxW)."""
        self.__check_input(in_)
        if len(order) != len(self.inputs[in_]) - 1:
            raise Exception("Transpose order needs to have the same number of dimensions "
                            "as the input.")
        self.transpose[in_] = order

    def set_channel_swap(self, in_, order):
        """The order to take the channels in, after the transpose (``(2, 1, 0)``: RGB->BGR)."""
        self.__check_input(in_)
        if len(order) != self.inputs[in_][1]:
            raise Exception("Channel swap needs to have the same number of dimensions as "
                            "the input channels.")
        self.channel_swap[in_] = order

    def set_raw_scale(self, in_, scale):
        """Scale applied to raw input before the mean (255 for models trained on [0, 255])."""
        self.__check_input(in_)
        self.raw_scale[in_] = scale

    def set_mean(self, in_, mean):
        """The mean to subtract: per channel (K,) or elementwise (K x H x W, resized to the
        input size if it differs)."""
        self.__check_input(in_)
        mean = np.asarray(mean)
        ms = mean.shape
        if mean.ndim == 1:
            if ms[0] != self.inputs[in_][1]:
                raise ValueError("Mean channels incompatible with input.")
            mean = mean[:, np.newaxis, np.newaxis]
        else:
            if len(ms) == 2:
                ms = (1,) + ms
            if len(ms) != 3:
                raise ValueError("Mean shape invalid")
            if ms != tuple(self.inputs[in_][1:]):
                in_shape = self.inputs[in_][1:]
                mean = mean.reshape(ms)
                m_min, m_max = mean.min(), mean.max()
                normal_mean = (mean - m_min) / (m_max - m_min) if m_max > m_min else mean - m_min
                mean = resize_image(normal_mean.transpose((1, 2, 0)),
                                    in_shape[1:]).transpose((2, 0, 1)) * (m_max - m_min) + m_min
        self.mean[in_] = mean

    def set_input_scale(self, in_, scale):
        """Scale applied last, after the mean (e.g. 0.017 for some models)."""
        self.__check_input(in_)
        self.input_scale[in_] = scale


# -- image IO -------------------------------------------------------------------------------------
def _to_float01(arr):
    """skimage's img_as_float: integers scaled by their dtype's maximum."""
    if arr.dtype == np.bool_:
        return arr.astype(np.float32)
    if np.issubdtype(arr.dtype, np.integer):
        info = np.iinfo(arr.dtype)
        return (arr.astype(np.float64) / info.max).clip(0 if info.min == 0 else -1, 1)
    return arr.astype(np.float64)


def load_image(filename, color=True):
    """An image as float32 in [0, 1]: H x W x 3 (RGB) when ``color``, else H x W x 1
    (colour images are converted to intensity with skimage's weights
    0.2125 R + 0.7154 G + 0.0721 B).  Alpha is dropped."""
    try:
        from PIL import Image
    except ImportError:
        raise MinicaffeError("load_image needs Pillow (pip install \".[data]\")") from None
    try:
        im = Image.open(filename)
        im.load()
    except FileNotFoundError:
        raise MinicaffeError(f"{filename}: no such image file") from None
    except OSError as e:
        raise MinicaffeError(f"{filename}: cannot read image ({e})") from None
    if im.mode == "P":
        im = im.convert("RGBA" if "transparency" in im.info else "RGB")
    elif im.mode in ("CMYK", "YCbCr", "LAB", "HSV"):
        im = im.convert("RGB")
    elif im.mode == "LA":
        im = im.convert("L")
    elif im.mode == "PA":
        im = im.convert("RGBA")
    arr = np.asarray(im)
    if im.mode.startswith("I;16"):
        arr = arr.astype(np.uint16)
    img = _to_float01(arr)
    if img.ndim == 3 and img.shape[2] == 4:
        img = img[:, :, :3]
    if not color and img.ndim == 3:
        img = img[:, :, 0] * 0.2125 + img[:, :, 1] * 0.7154 + img[:, :, 2] * 0.0721
    img = img.astype(np.float32)
    if img.ndim == 2:
        img = img[:, :, np.newaxis]
        if color:
            img = np.tile(img, (1, 1, 3))
    return img


def _axis_weights(n_in, n_out, order):
    """Source indices and weights along one axis (pixel-centre aligned, edges clamped)."""
    scale = n_in / n_out
    x = (np.arange(n_out) + 0.5) * scale - 0.5
    if order == 0:
        i0 = np.clip(np.floor(x + 0.5).astype(np.int64), 0, n_in - 1)
        return i0, i0, np.zeros(n_out)
    x = np.clip(x, 0, n_in - 1)
    i0 = np.floor(x).astype(np.int64)
    i1 = np.minimum(i0 + 1, n_in - 1)
    return i0, i1, x - i0


def _resize(im, new_dims, order):
    h, w = new_dims
    r0, r1, rw = _axis_weights(im.shape[0], h, order)
    c0, c1, cw = _axis_weights(im.shape[1], w, order)
    im = im.astype(np.float64)
    rw = rw.reshape((-1, 1) + (1,) * (im.ndim - 2))
    cw = cw.reshape((1, -1) + (1,) * (im.ndim - 2))
    top = im[r0] * (1 - rw) + im[r1] * rw
    return top[:, c0] * (1 - cw) + top[:, c1] * cw


def resize_image(im, new_dims, interp_order=1):
    """Resize an H x W x K image to ``new_dims`` = (height, width): bilinear
    (``interp_order=1``) or nearest (``0``).  Returns float32."""
    new_dims = tuple(int(d) for d in new_dims)
    if interp_order not in (0, 1):
        raise ValueError(f"resize_image supports interp_order 0 (nearest) or 1 (linear), "
                         f"got {interp_order}")
    im = np.asarray(im)
    if im.shape[-1] in (1, 3):
        im_min, im_max = im.min(), im.max()
        if im_max > im_min:
            # as pycaffe: resize the image normalised to [0, 1], then scale back
            im_std = (im - im_min) / (im_max - im_min)
            resized = _resize(im_std, new_dims, interp_order) * (im_max - im_min) + im_min
        else:
            ret = np.empty((new_dims[0], new_dims[1], im.shape[-1]), dtype=np.float32)
            ret.fill(im_min)
            return ret
    else:
        resized = _resize(im, new_dims, interp_order)
    return resized.astype(np.float32)


def oversample(images, crop_dims):
    """The four corner crops and the centre crop of each image, then their mirrors:
    (10 * N) x h x w x K float32, ordered per image as pycaffe."""
    im_shape = np.array(images[0].shape)
    crop_dims = np.array(crop_dims)
    im_center = im_shape[:2] / 2.0
    h_indices = (0, im_shape[0] - crop_dims[0])
    w_indices = (0, im_shape[1] - crop_dims[1])
    crops_ix = np.empty((5, 4), dtype=int)
    curr = 0
    for i in h_indices:
        for j in w_indices:
            crops_ix[curr] = (i, j, i + crop_dims[0], j + crop_dims[1])
            curr += 1
    crops_ix[4] = np.tile(im_center, (1, 2)) + np.concatenate([-crop_dims / 2.0,
                                                                crop_dims / 2.0])
    crops_ix = np.tile(crops_ix, (2, 1))
    crops = np.empty((10 * len(images), crop_dims[0], crop_dims[1], im_shape[-1]),
                     dtype=np.float32)
    ix = 0
    for im in images:
        for crop in crops_ix:
            crops[ix] = im[crop[0]:crop[2], crop[1]:crop[3], :]
            ix += 1
        crops[ix - 5:ix] = crops[ix - 5:ix, :, ::-1, :]  # mirrors
    return crops
