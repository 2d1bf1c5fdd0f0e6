"""Images as Caffe sees them: (channels, height, width) uint8 arrays in BGR order.

Caffe reads and decodes images with OpenCV, which gives BGR; its datasets and its
published mean values (104, 117, 123) are BGR.  Here JPEGs are decoded by
``simplejpeg`` (libjpeg-turbo, straight into BGR; ``pip install minicaffe[jpeg]``) when
it is installed, and everything else (and every JPEG without it) by Pillow, the channels
reversed to match.  Both run libjpeg-turbo with its defaults (accurate integer IDCT,
fancy upsampling), so they give the same pixels; ``decoder_name()`` says which runs.
Gray requests of colour JPEGs and CMYK JPEGs always go through Pillow.  ``resize`` follows OpenCV's INTER_LINEAR
(``cv::resize`` default: half-pixel centres, no antialiasing), computed in float
and rounded, so results agree with OpenCV within one grey level.

    decode_image(bytes, color=None)            color True: 3 channels, False: 1,
                                               None: as stored (gray 1, colour 3, alpha 4)
    read_image(path, height=0, width=0, is_color=True)   Caffe's ReadImageToCVMat
    encode_image(chw, "png" | "jpg")           Caffe's cv::imencode (JPEG quality 95)
"""
import io
import os

import numpy as np

from ..core.errors import MinicaffeError


class ImageError(MinicaffeError):
    """An image that cannot be read or decoded."""


def _pil():
    try:
        from PIL import Image
    except ImportError:
        raise ImageError("reading images needs Pillow (pip install Pillow, or "
                         "pip install \".[data]\")") from None
    return Image


def _to_chw_bgr(im, color):
    """Pillow image -> (C, H, W) uint8 (a view, not necessarily contiguous)."""
    mode = im.mode
    if color is True:
        if mode != "RGB":
            im = im.convert("RGB")
    elif color is False:
        if mode != "L":
            im = im.convert("L")
    else:  # native: keep gray as 1 channel, alpha as a 4th channel
        if mode in ("1", "L"):
            im = im.convert("L") if mode != "L" else im
        elif mode in ("I;16", "I;16B", "I;16L", "I", "F"):
            a = np.asarray(im)
            if mode != "F" and a.size and a.max() > 255:  # 16-bit: keep the high byte
                a = a >> 8
            return np.clip(a, 0, 255).astype(np.uint8)[None]
        elif mode in ("RGBA", "LA", "PA") or (mode == "P" and "transparency" in im.info):
            im = im.convert("RGBA") if mode != "RGBA" else im
        elif mode != "RGB":
            im = im.convert("RGB")
    a = np.asarray(im)
    if a.ndim == 2:
        return a[None]
    if a.shape[2] == 4:
        return a[:, :, [2, 1, 0, 3]].transpose(2, 0, 1)
    return a[:, :, ::-1].transpose(2, 0, 1)


_simplejpeg = None


def _sj():
    """The simplejpeg module, or False when it is not installed."""
    global _simplejpeg
    if _simplejpeg is None:
        try:
            import simplejpeg
            _simplejpeg = simplejpeg
        except ImportError:
            _simplejpeg = False
    return _simplejpeg


def decoder_name():
    """The JPEG decoder ``decode_image`` uses: "simplejpeg" or "Pillow"."""
    return "simplejpeg" if _sj() else "Pillow"


def _decode_jpeg(sj, data, color):
    """(C, H, W) BGR/gray by simplejpeg, or None where Pillow must decode."""
    try:
        _, _, space, _ = sj.decode_jpeg_header(data)
    except ValueError:
        return None  # not a JPEG libjpeg-turbo reads: Pillow says why
    gray = space == "Gray"
    if space not in ("Gray", "YCbCr") or (color is False and not gray):
        return None
    if gray and color is not True:
        return sj.decode_jpeg(data, colorspace="GRAY", fastdct=False, fastupsample=False
                              ).reshape(1, *sj.decode_jpeg_header(data)[:2])
    a = sj.decode_jpeg(data, colorspace="BGR", fastdct=False, fastupsample=False)
    return a.transpose(2, 0, 1)


def decode_image(data, color=None, where="image"):
    """Decode PNG/JPEG/... bytes into (C, H, W) uint8 BGR; ImageError naming ``where``."""
    sj = _sj() if data[:2] == b"\xff\xd8" else None
    if sj:
        try:
            img = _decode_jpeg(sj, data, color)
        except ValueError:
            img = None  # a corrupt JPEG: Pillow's message names the problem
        if img is not None:
            return img
    Image = _pil()
    try:
        with Image.open(io.BytesIO(data)) as im:
            im.load()
            return _to_chw_bgr(im, color)
    except ImageError:
        raise
    except Exception as e:  # UnidentifiedImageError, OSError (truncated), SyntaxError...
        raise ImageError(f"{where}: cannot decode image ({type(e).__name__}: {e})") from None


def read_image(path, height=0, width=0, is_color=True, where=None):
    """Caffe's ReadImageToCVMat: decode ``path`` (3 channels BGR if ``is_color``, else 1)
    and resize to (height, width) when both are positive."""
    where = where or path
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise ImageError(f"{where}: could not open or find file {path}") from None
    except OSError as e:
        raise ImageError(f"{where}: cannot read {path} ({e.strerror})") from None
    img = decode_image(data, bool(is_color), where)
    if height > 0 and width > 0:
        img = resize(img, height, width)
    return img


def _linear_taps(n_out, n_in):
    """OpenCV INTER_LINEAR source indices and weights along one axis."""
    scale = n_in / n_out
    f = (np.arange(n_out, dtype=np.float64) + 0.5) * scale - 0.5
    i0 = np.floor(f).astype(np.int64)
    w = f - i0
    low = i0 < 0
    w[low] = 0.0
    i0[low] = 0
    high = i0 >= n_in - 1
    w[high] = 0.0
    i0[high] = n_in - 1
    i1 = np.minimum(i0 + 1, n_in - 1)
    return i0, i1, w.astype(np.float32)


def resize(img, height, width):
    """Bilinear resize of a (C, H, W) uint8 image as OpenCV's INTER_LINEAR."""
    c, h, w = img.shape
    if (h, w) == (height, width):
        return img
    y0, y1, wy = _linear_taps(height, h)
    x0, x1, wx = _linear_taps(width, w)
    a = img.astype(np.float32)
    rows = a[:, y0, :] * (1 - wy)[None, :, None] + a[:, y1, :] * wy[None, :, None]
    out = rows[:, :, x0] * (1 - wx) + rows[:, :, x1] * wx
    return np.clip(np.floor(out + 0.5), 0, 255).astype(np.uint8)


_FORMATS = {"jpg": "JPEG", "jpeg": "JPEG", "png": "PNG", "bmp": "BMP", "tif": "TIFF",
            "tiff": "TIFF", "ppm": "PPM", "pgm": "PPM", "webp": "WEBP"}


def encode_image(img, fmt="png"):
    """Encode a (C, H, W) uint8 BGR (or gray) image; ``fmt`` as Caffe's encode_type."""
    Image = _pil()
    key = fmt.lower().lstrip(".")
    if key not in _FORMATS:
        raise ImageError(f"unknown image encoding '{fmt}' (use one of {', '.join(sorted(_FORMATS))})")
    a = np.asarray(img, dtype=np.uint8)
    if a.ndim == 3 and a.shape[0] == 1:
        pil = Image.fromarray(np.ascontiguousarray(a[0]), "L")
    elif a.ndim == 3 and a.shape[0] == 3:
        pil = Image.fromarray(np.ascontiguousarray(a[::-1].transpose(1, 2, 0)), "RGB")
    elif a.ndim == 3 and a.shape[0] == 4:
        pil = Image.fromarray(np.ascontiguousarray(a[[2, 1, 0, 3]].transpose(1, 2, 0)), "RGBA")
    elif a.ndim == 2:
        pil = Image.fromarray(np.ascontiguousarray(a), "L")
    else:
        raise ImageError(f"cannot encode an image of shape {a.shape}")
    buf = io.BytesIO()
    kw = {"quality": 95} if _FORMATS[key] == "JPEG" else {}
    pil.save(buf, format=_FORMATS[key], **kw)
    return buf.getvalue()


def file_extension(path):
    return os.path.splitext(path)[1].lower().lstrip(".")
