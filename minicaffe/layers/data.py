"""In-memory input layers: Input, DummyData, MemoryData (file-backed data layers
live in ``data_layers``)."""
import numpy as np

from ..core.filler import fill
from .layer import Layer
from .registry import register_layer


def _shape(s):
    return tuple(int(d) for d in s.dim)


@register_layer("Input")
class InputLayer(Layer):
    """Tops of fixed shapes that the user fills (``input_param { shape { dim: ... } }``,
    one shape for all tops or one per top)."""
    capturable = True
    graph_prologue = True   # the user writes these tops between iterations
    min_top_blobs = 1

    def layer_setup(self, bottom, top):
        shapes = self.layer_param.input_param.shape
        if len(shapes) not in (0, 1, len(top)):
            raise self.error(f"must specify 'shape' once, once per top blob, or not at all: "
                             f"{len(top)} tops vs. {len(shapes)} shapes")
        if len(shapes):
            for i, t in enumerate(top):
                t.reshape(_shape(shapes[0] if len(shapes) == 1 else shapes[i]))

    def reshape(self, bottom, top):
        pass

    def forward_cpu(self, bottom, top):
        pass

    forward_gpu = forward_cpu


@register_layer("DummyData")
class DummyDataLayer(Layer):
    """Tops filled by fillers: constant ones once at setup, random ones every forward."""
    graph_prologue = True
    exact_num_bottom_blobs = 0
    min_top_blobs = 1

    def layer_setup(self, bottom, top):
        p = self.layer_param.dummy_data_param
        n = len(top)
        nf = len(p.data_filler)
        if nf not in (0, 1, n):
            raise self.error(f"number of data fillers must be 0, 1 or equal to the number of "
                             f"tops: {n}; you specified {nf} data fillers")
        legacy = len(p.num) > 0 or len(p.channels) > 0 or len(p.height) > 0 or len(p.width) > 0
        if legacy:
            if len(p.shape):
                raise self.error("both shape and legacy fields were specified")
            for f in (p.num, p.channels, p.height, p.width):
                if len(f) not in (1, n):
                    raise self.error("legacy num/channels/height/width must be given 1 or num_top times")
            pick = lambda f, i: f[0] if len(f) == 1 else f[i]
            shapes = [(pick(p.num, i), pick(p.channels, i), pick(p.height, i), pick(p.width, i))
                      for i in range(n)]
        else:
            if len(p.shape) not in (1, n):
                raise self.error(f"shape must be specified 1 or num_top ({n}) times")
            shapes = [_shape(p.shape[0] if len(p.shape) == 1 else p.shape[i]) for i in range(n)]
        from ..proto import caffe_pb2
        self.fillers = []
        for i in range(n):
            if nf == 0:
                f = caffe_pb2.FillerParameter(type="constant", value=0)
            else:
                f = p.data_filler[0] if nf == 1 else p.data_filler[i]
            self.fillers.append(f)
        self.refill = [f.type != "constant" for f in self.fillers]
        for i, t in enumerate(top):
            t.reshape(shapes[i])
            fill(t, self.fillers[i])

    def reshape(self, bottom, top):
        pass

    def forward_cpu(self, bottom, top):
        for i, t in enumerate(top):
            if self.refill[i]:
                fill(t, self.fillers[i])

    forward_gpu = forward_cpu


@register_layer("MemoryData")
class MemoryDataLayer(Layer):
    """Batches from arrays given with ``set_input_arrays(data, labels)`` (pycaffe) or
    ``reset``: data top (batch, channels, height, width), label top (batch,)."""
    graph_prologue = True
    exact_num_bottom_blobs = 0
    exact_num_top_blobs = 2

    def layer_setup(self, bottom, top):
        p = self.layer_param.memory_data_param
        self.batch_size = p.batch_size
        self.shape = (p.channels, p.height, p.width)
        if self.batch_size <= 0 or min(self.shape) <= 0:
            raise self.error("batch_size, channels, height and width must all be positive")
        top[0].reshape((self.batch_size,) + self.shape)
        top[1].reshape((self.batch_size,))
        self.data = None
        self.labels = None
        self.pos = 0

    def reshape(self, bottom, top):
        top[0].reshape((self.batch_size,) + self.shape)
        top[1].reshape((self.batch_size,))

    def reset(self, data, labels):
        data = np.ascontiguousarray(data, dtype=np.float32)
        labels = np.ascontiguousarray(labels, dtype=np.float32).reshape(-1)
        if data.ndim != 4 or data.shape[1:] != self.shape:
            raise self.error(f"data must have shape (n, {', '.join(map(str, self.shape))}), "
                             f"got {data.shape}")
        if data.shape[0] != labels.shape[0]:
            raise self.error(f"data and labels must have the same length "
                             f"({data.shape[0]} vs {labels.shape[0]})")
        if data.shape[0] % self.batch_size:
            raise self.error(f"the number of samples ({data.shape[0]}) must be a multiple of "
                             f"batch_size ({self.batch_size})")
        if self.layer_param.HasField("transform_param"):
            from ..core import log
            log.warning("%s does not transform array data on Reset()", self.type)
        self.data, self.labels, self.pos = data, labels, 0

    set_input_arrays = reset

    def _transformer(self):
        if getattr(self, "_transform", None) is None:
            from ..data.prefetch import effective_transform_param
            from ..data.transformer import DataTransformer
            from ..core.errors import MinicaffeError
            try:
                self._transform = DataTransformer(effective_transform_param(self.layer_param),
                                                  self.phase)
            except MinicaffeError as e:
                raise self.error(str(e)) from None
        return self._transform

    def add_mat_vector(self, images, labels):
        """Caffe's AddMatVector: (C, H, W) images (e.g. BGR uint8) go through
        ``transform_param`` (crop, mirror, mean, scale) into (channels, height, width)."""
        from ..core.errors import MinicaffeError
        images = list(images)
        labels = np.asarray(labels, dtype=np.float32).reshape(-1)
        if not images:
            raise self.error("there is no image to add")
        if len(images) % self.batch_size:
            raise self.error(f"the added data must be a multiple of the batch size "
                             f"({len(images)} vs {self.batch_size})")
        if len(images) != len(labels):
            raise self.error(f"{len(images)} images but {len(labels)} labels")
        t = self._transformer()
        images = [np.asarray(a)[None] if np.asarray(a).ndim == 2 else np.asarray(a) for a in images]
        try:
            shape = t.output_shape(tuple(images[0].shape), f"layer '{self.name}'")
        except MinicaffeError as e:
            raise self.error(str(e).split(": ", 1)[-1]) from None
        if shape != self.shape:
            raise self.error(f"transformed images have shape {shape}, memory_data_param says "
                             f"{self.shape}")
        for i, a in enumerate(images):
            if a.shape != images[0].shape:
                raise self.error(f"image {i} has shape {a.shape}, image 0 has {images[0].shape}")
        out = np.empty((len(images),) + shape, dtype=np.float32)
        t.transform(images, out)
        self.data, self.labels, self.pos = out, labels, 0

    def add_datum_vector(self, datums):
        """Caffe's AddDatumVector: Datums (raw or encoded) through ``transform_param``."""
        datums = list(datums)
        t = self._transformer()
        self.add_mat_vector([t.decode(d, f"datum {i}") for i, d in enumerate(datums)],
                            [d.label for d in datums])

    def set_batch_size(self, n):
        self.batch_size = int(n)

    def forward_cpu(self, bottom, top):
        if self.data is None:
            raise self.error("MemoryDataLayer needs to be initialized by calling reset "
                             "(set_input_arrays) before forward")
        b = self.batch_size
        top[0].mutable_cpu_data()[...] = self.data[self.pos:self.pos + b]
        top[1].mutable_cpu_data()[...] = self.labels[self.pos:self.pos + b]
        self.pos = (self.pos + b) % self.data.shape[0]

    forward_gpu = forward_cpu
