"""JPEG decode on the GPU with nvImageCodec (nvJPEG), into a device batch in Caffe's layout.

Caffe decodes with OpenCV on the CPU (``cv::imdecode``, BGR); so does minicaffe by default
(``data/images.py``: simplejpeg or Pillow, libjpeg-turbo).  With ``minicaffe train
--gpu_decode`` (``RunConfig.gpu_decode``) the Data/ImageData layers hand a batch's JPEG
bytes to this module instead, which decodes them in one ``Decoder.decode`` call on the
prefetch thread's stream and writes a (N, C, H, W) uint8 BGR device batch, then the
transform kernel (``kernels/transform.py``) runs on it as on an uploaded batch.

Contract:

- ``require()``: the nvImageCodec module; ``GpuDecodeUnavailable`` (one line naming
  ``pip install ".[gpu-jpeg]"``) when it does not import or finds no nvJPEG.
- ``JpegBatchDecoder(device_id)``: ``probe(data)`` -> (stored channels, height, width,
  parsed code stream) of a baseline/progressive 8-bit JPEG in YCbCr or gray that nvJPEG
  decodes, else None (PNG, CMYK, not a JPEG, unreadable header: the caller decodes those
  on the CPU); ``decode_into(code_streams, out, index, stream)`` decodes the probed code
  streams into ``out[index[k]]`` (``out``: a (N, C, H, W) uint8 CuPy array, C 3 = BGR or
  1 = gray) on ``stream`` and returns the positions in ``code_streams`` that nvImageCodec
  could not decode (the caller decodes those on the CPU: a corrupt record then gets the
  CPU decoder's one-line error).
- Pixels: libjpeg-turbo's defaults are matched where nvJPEG allows it (fancy upsampling of
  the chroma, no EXIF rotation), but nvJPEG's IDCT is not libjpeg-turbo's accurate integer
  IDCT: pixels may differ from the CPU decode by a few levels (``TOLERANCE``, tested on the
  GPU).  The hardware JPEG engine (A100/H100) is not used: it has no fancy upsampling.
"""
from ..core.errors import ConfigError

INSTALL = 'pip install ".[gpu-jpeg]"'
# the largest difference from the CPU decode (libjpeg-turbo) that tests accept, in grey
# levels: the largest over all pixels, and the mean absolute difference
TOLERANCE = {"max": 8, "mean": 1.0}


_PROBE_JPEG = (  # a 16x16 colour JPEG, decoded once to check that nvJPEG runs
    "/9j/4AAQSkZJRgABAQAAAQABAAD/2wBDABALDA4MChAODQ4SERATGCgaGBYWGDEjJR0oOjM9PDkzODdASFxO"
    "QERXRTc4UG1RV19iZ2hnPk1xeXBkeFxlZ2P/2wBDARESEhgVGC8aGi9jQjhCY2NjY2NjY2NjY2NjY2NjY2Nj"
    "Y2NjY2NjY2NjY2NjY2NjY2NjY2NjY2NjY2NjY2NjY2P/wAARCAAQABADASIAAhEBAxEB/8QAHwAAAQUBAQEB"
    "AQEAAAAAAAAAAAECAwQFBgcICQoL/8QAtRAAAgEDAwIEAwUFBAQAAAF9AQIDAAQRBRIhMUEGE1FhByJxFDKB"
    "kaEII0KxwRVS0fAkM2JyggkKFhcYGRolJicoKSo0NTY3ODk6Q0RFRkdISUpTVFVWV1hZWmNkZWZnaGlqc3R1"
    "dnd4eXqDhIWGh4iJipKTlJWWl5iZmqKjpKWmp6ipqrKztLW2t7i5usLDxMXGx8jJytLT1NXW19jZ2uHi4+Tl"
    "5ufo6erx8vP09fb3+Pn6/8QAHwEAAwEBAQEBAQEBAQAAAAAAAAECAwQFBgcICQoL/8QAtREAAgECBAQDBAcF"
    "BAQAAQJ3AAECAxEEBSExBhJBUQdhcRMiMoEIFEKRobHBCSMzUvAVYnLRChYkNOEl8RcYGRomJygpKjU2Nzg5"
    "OkNERUZHSElKU1RVVldYWVpjZGVmZ2hpanN0dXZ3eHl6goOEhYaHiImKkpOUlZaXmJmaoqOkpaanqKmqsrO0"
    "tba3uLm6wsPExcbHyMnK0tPU1dbX2Nna4uPk5ebn6Onq8vP09fb3+Pn6/9oADAMBAAIRAxEAPwCjLaaHBs8p"
    "J7ndnPlQ42/Xdj9KliTSP+fC+/79J/8AFVqrHrDIVFlZKSMBhE2R78tVOUalZyCO71e2gcjcFlWFSR64I9qA"
    "P//Z")


class GpuDecodeUnavailable(ConfigError):
    """GPU decode was asked for but nvImageCodec (or nvJPEG) cannot run."""


def require():
    """The ``nvidia.nvimgcodec`` module, or GpuDecodeUnavailable (one line)."""
    try:
        from nvidia import nvimgcodec
    except Exception as e:  # ImportError, or a library that fails to load
        raise GpuDecodeUnavailable(
            f"--gpu_decode needs nvImageCodec and nvJPEG ({INSTALL}): cannot import "
            f"nvidia.nvimgcodec ({type(e).__name__}: {e})".replace("\n", " ")) from None
    return nvimgcodec


def _cupy():
    import cupy
    return cupy


class JpegBatchDecoder:
    """nvImageCodec's batch decoder on device ``device_id`` (see the module docstring)."""

    def __init__(self, device_id):
        n = require()
        try:
            self.decoder = n.Decoder(
                device_id=int(device_id),
                backends=[n.Backend(n.BackendKind.GPU_ONLY),
                          n.Backend(n.BackendKind.HYBRID_CPU_GPU)],
                options=":fancy_upsampling=1")
        except Exception as e:
            raise GpuDecodeUnavailable(f"--gpu_decode: nvImageCodec cannot decode on GPU "
                                       f"{device_id} ({type(e).__name__}: {e}); install "
                                       f"nvJPEG with {INSTALL}".replace("\n", " ")) from None
        self._n = n
        self._params = {
            3: n.DecodeParams(apply_exif_orientation=False, color_spec=n.ColorSpec.SRGB,
                              allow_any_depth=False, sample_format=n.SampleFormat.I_RGB),
            1: n.DecodeParams(apply_exif_orientation=False, color_spec=n.ColorSpec.GRAY,
                              allow_any_depth=False, sample_format=n.SampleFormat.I_Y)}
        self._jpeg_spaces = (n.ColorSpec.SYCC, n.ColorSpec.GRAY, n.ColorSpec.SRGB)
        import base64
        try:
            ok = self.decoder.decode(n.CodeStream(base64.b64decode(_PROBE_JPEG)),
                                     params=self._params[3]) is not None
        except Exception:
            ok = False
        if not ok:
            raise GpuDecodeUnavailable(f"--gpu_decode: nvImageCodec cannot decode a JPEG on "
                                       f"GPU {device_id} (is nvJPEG installed? {INSTALL})")

    def probe(self, data):
        """(stored channels, height, width, code stream) of a JPEG nvJPEG decodes, else
        None."""
        if data is None or data[:2] != b"\xff\xd8":
            return None
        try:
            cs = self._n.CodeStream(bytes(data))
            if cs.codec_name != "jpeg" or cs.color_spec not in self._jpeg_spaces:
                return None
            c = int(cs.num_channels)
            if c not in (1, 3) or cs.precision not in (0, 8):
                return None
            return c, int(cs.height), int(cs.width), cs
        except Exception:
            return None

    def decode_into(self, code_streams, out, index, stream):
        """Decode ``code_streams`` (``probe``'s) into ``out[index[k]]`` (BGR, or gray when
        ``out`` has one channel) on ``stream``; the positions nvImageCodec could not
        decode."""
        if not code_streams:
            return []
        cp = _cupy()
        c = int(out.shape[1])
        with stream:
            try:
                images = self.decoder.decode(list(code_streams), params=self._params[c],
                                             cuda_stream=int(stream.ptr))
            except Exception:
                return list(range(len(code_streams)))
            failed = []
            for k, img in enumerate(images):
                if img is None:
                    failed.append(k)
                    continue
                hwc = cp.asarray(img)  # (H, W, C) RGB or (H, W, 1), rows may be padded
                if c == 3:
                    out[index[k]] = hwc[:, :, ::-1].transpose(2, 0, 1)
                else:
                    out[index[k], 0] = hwc[:, :, 0]
            # the decoded images' buffers must outlive the copies queued on the stream
            stream.synchronize()
        return failed
