"""The solver update as one GPU kernel over the flat parameter buffers.

Caffe's update, per parameter and element (each rule's CUDA body is its solver class's
``fused_rule`` in ``sgd_solvers.py``, beside the array body it matches): clip
(global L2 norm), normalise by iter_size, regularise (L2 or L1 weight decay), the
type's rule, then ``w -= update`` and ``diff = update`` (Caffe leaves the update value in
the diff).  With fp16 loss scaling the kernel first reads the scaler's device flag and
changes nothing when the step's gradients were not finite (the step is skipped without a
host branch).  On the GPU the parameters, their diffs and the history live in flat buffers
of one layout (``flat_params.py``), so all of it is one kernel launch per iteration: each
element finds its parameter through a chunk table (the layout aligns parameters to
``ALIGN`` elements, so a 64-element chunk never straddles two), and reads that
parameter's lr_mult and decay from small tables.

Per-iteration scalars (the learning rate, Adam's bias correction) come from a slot of a
ring in mapped host memory indexed by the device's iteration counter, copied once into
device memory by a one-thread kernel before the update (``kernels/step.py``), so the
same launch replays correctly from a CUDA graph while the host writes later slots.  With the
project's NVRTC options (no multiply-add contraction) each element is rounded exactly as
the numpy bodies round it.
"""
import numpy as np

from ..core import backend
from ..core.flat_params import ALIGN

CHUNK = 64
assert ALIGN % CHUNK == 0

_TEMPLATE = r"""
extern "C" __global__ void mc_update(T* w, T* gdiff, T* h, T* h2, const int* table,
    const float* lr_tab, const float* decay_tab, const long long* off_tab,
    const long long* cnt_tab, const float* sc, const float* sumsq, const int* skip,
    float clip, float inv_iter_size, int l1, long long n, EXTRA) {
  if (skip != 0 && skip[0] != 0) return;   // fp16 loss scaling: a non-finite gradient
  const float rate = sc[0];
  float clip_scale = 1.0f;
  bool clipping = false;
  if (sumsq != 0) {
    float norm = sqrtf(sumsq[0]);
    if (norm > clip) { clip_scale = clip / norm; clipping = true; }
  }
  CUDA_KERNEL_LOOP(i, n) {
    const int p = table[i / CHUNK];
    if (i - off_tab[p] >= cnt_tab[p]) continue;   // the gap after a parameter
    T g = gdiff[i];
    if (clipping) g *= clip_scale;
    if (inv_iter_size != 1.0f) g *= inv_iter_size;
    const float decay = decay_tab[p];
    if (decay != 0.0f) {
      T wi = w[i];
      if (l1) g += (T)((wi > 0) - (wi < 0)) * decay; else g += wi * decay;
    }
    const T lr = rate * lr_tab[p];
    T u;
    BODY
    gdiff[i] = u;
    w[i] = w[i] - u;
  }
}
"""


def _kernel(rule, dtype):
    """The update kernel of ``rule`` (a solver class's ``fused_rule``: extra scalar
    parameters, history sets, CUDA body) for ``dtype``."""
    from ..kernels._backend import cuda_type, raw_kernel
    extra, _, body = rule
    src = (_TEMPLATE.replace("EXTRA", extra).replace("BODY", body)
           .replace("CHUNK", str(CHUNK)))
    return raw_kernel(src, "mc_update", cuda_type(dtype))


class FusedUpdate:
    """The update of ``solver`` (an SGD-family solver with flat buffers) as one kernel."""

    def __init__(self, solver):
        cp = backend.gpu_module()
        self.solver = solver
        self.rule = solver.type
        rule = getattr(solver, "fused_rule", None)
        if rule is None:
            raise ValueError(f"no fused update for solver type {self.rule}")
        net = solver.net
        self.flat = net.flat_params()
        self.dtype = self.flat.dtype
        hist = solver.history_flat
        if len(hist) != rule[1]:
            raise ValueError(f"{self.rule} keeps {rule[1]} history sets, "
                             f"the solver has {len(hist)}")
        self.hist = hist
        p = solver.param
        self.table = cp.asarray(self.flat.layout.chunk_table(CHUNK))
        self.off_tab = cp.asarray(np.array(self.flat.offsets or [0], dtype=np.int64))
        self.cnt_tab = cp.asarray(np.array(self.flat.counts or [0], dtype=np.int64))
        n = len(self.flat.blobs)
        self.lr_tab = cp.asarray(np.array([np.float32(v) for v in net.params_lr] or [0],
                                          dtype=np.float32))
        wd = np.float32(p.weight_decay)
        self.decay_tab = cp.asarray(np.array([np.float32(wd * np.float32(v))
                                              for v in net.params_weight_decay] or [0],
                                             dtype=np.float32))
        assert n == len(net.params_lr)
        self.scalars = tuple(solver.fused_scalars())
        self.clip = np.float32(p.clip_gradients)
        self.inv_iter_size = np.float32(np.float32(1) / np.float32(p.iter_size))
        self.l1 = np.int32(p.regularization_type == "L1")
        self.kernel = _kernel(rule, self.dtype)

    def intact(self):
        return self.flat.intact() and all(h.intact() for h in self.hist)

    def launch(self, scalars, sumsq=None, skip=None):
        """One launch on the current stream.  ``scalars``: this iteration's scalars in
        device memory (the learning rate, the rule's extra); ``sumsq`` (a device float[1]
        holding the squared global norm) turns clipping on; ``skip`` (a device int[1], the
        loss scaler's non-finite flag, engine/precision.DeviceLossScale) makes the launch
        change nothing (weights, diffs, history) when it holds a non-zero value."""
        from ..kernels._backend import launch
        w = self.flat.data.mutable_gpu_data()
        g = self.flat.diff.mutable_gpu_data()
        h = self.hist[0].data.mutable_gpu_data()
        h2 = self.hist[1].data.mutable_gpu_data() if len(self.hist) > 1 else h
        launch(self.kernel, w.size,
               (w, g, h, h2, self.table, self.lr_tab, self.decay_tab, self.off_tab, self.cnt_tab,
                scalars, sumsq if sumsq is not None else np.uint64(0),
                skip if skip is not None else np.uint64(0),
                self.clip, self.inv_iter_size, self.l1, np.int64(w.size)) + self.scalars)
