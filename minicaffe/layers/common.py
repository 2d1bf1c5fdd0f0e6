"""Common layers: InnerProduct, Embed, Split, Concat, Slice, Eltwise, Flatten,
Reshape, Tile, Reduction, ArgMax, Softmax, Silence, Filter, BatchReindex,
Parameter.

Layers that only change a blob's shape (Flatten, Reshape, a one-bottom Concat,
a one-top Slice) share the bottom's data and diff with the top: no copies.
Index bottoms (Embed's input, Filter's selector, BatchReindex's permutation)
receive no gradient.
"""
import numpy as np

from ..core import backend
from ..core.blob import Blob
from ..core.filler import fill
from .layer import CAST_WEIGHTS, Layer
from ..proto import caffe_pb2
from ..kernels.blas import gemm
from .registry import register_layer


def _canonical(layer, blob, axis, what="axis"):
    try:
        return blob.canonical_axis_index(axis)
    except IndexError:
        raise layer.error(f"{what} {axis} is out of range for bottom shape {blob.shape}") from None


def _scatter_add(xp, a, index, values):
    """a[index] += values, summing repeated indices (``add.at``; CuPy before 13 has
    only ``cupyx.scatter_add``)."""
    if hasattr(xp.add, "at"):
        xp.add.at(a, index, values)
    else:
        backend.cupyx.scatter_add(a, index, values)


def _indices(layer, xp, data, high, what):
    """Integer indices from a float blob's data; one clear error when any is not an
    integer in [0, high)."""
    with np.errstate(invalid="ignore"):  # NaN: reported below
        idx = data.astype(np.int64)
    bad = (idx < 0) | (idx >= high) | (idx != data)
    if bool(bad.any()):
        first = float(data.reshape(-1)[int(xp.argmax(bad.reshape(-1)))])
        raise layer.error(f"{what} must be integers in [0, {high}); got {first}")
    return idx


@register_layer("InnerProduct")
class InnerProductLayer(Layer):
    """Fully connected: bottom (M, K) flattened from ``axis`` -> top (M, N).
    y = x W^T + b  (W is (N, K), or (K, N) with ``transpose``).
    dW += dy^T x, db += sum_m dy, dx = dy W."""
    capturable = True
    allow_in_place = False
    exact_num_bottom_blobs = 1
    exact_num_top_blobs = 1

    def layer_setup(self, bottom, top):
        p = self.layer_param.inner_product_param
        self.N = p.num_output
        if self.N <= 0:
            raise self.error(f"num_output must be positive, got {self.N}")
        self.bias_term = p.bias_term
        self.transpose = p.transpose
        axis = bottom[0].canonical_axis_index(p.axis)
        self.K = bottom[0].count(axis)
        wshape = (self.K, self.N) if self.transpose else (self.N, self.K)
        dtype = bottom[0].dtype
        if self.blobs:
            want = [wshape] + ([(self.N,)] if self.bias_term else [])
            if len(self.blobs) != len(want):
                raise self.error(f"expected {len(want)} parameter blobs, got {len(self.blobs)}")
            if self.blobs[0].shape != wshape:
                raise self.error(f"weight shape {self.blobs[0].shape} does not match {wshape}")
            return
        self.blobs = [Blob(wshape, dtype)]
        fill(self.blobs[0], p.weight_filler)
        if self.bias_term:
            self.blobs.append(Blob((self.N,), dtype))
            fill(self.blobs[1], p.bias_filler)
        self.param_propagate_down = [True] * len(self.blobs)

    def reshape(self, bottom, top):
        p = self.layer_param.inner_product_param
        axis = bottom[0].canonical_axis_index(p.axis)
        k = bottom[0].count(axis)
        if k != self.K:
            raise self.error(f"input size incompatible with inner product parameters: bottom "
                             f"{bottom[0].shape} gives {k} inputs per row, weights expect {self.K}")
        self.M = bottom[0].count(0, axis)
        top[0].reshape(bottom[0].shape[:axis] + (self.N,))

    def forward_xp(self, xp, bottom, top):
        x = bottom[0].data_for(xp).reshape(self.M, self.K)
        w = self.blobs[0].data_for(xp)
        y = top[0].mutable_data_for(xp).reshape(self.M, self.N)
        gemm(xp, x, w, y, trans_b=not self.transpose, tf32=self.config.tf32)
        if self.bias_term:
            y += self.blobs[1].data_for(xp)

    def backward_xp(self, xp, top, propagate_down, bottom):
        dy = top[0].diff_for(xp).reshape(self.M, self.N)
        x = bottom[0].data_for(xp).reshape(self.M, self.K)
        if self.get_param_propagate_down(0):
            dw = self.blobs[0].mutable_diff_for(xp)
            if self.transpose:
                gemm(xp, x, dy, dw, trans_a=True, beta=1.0, tf32=self.config.tf32)
            else:
                gemm(xp, dy, x, dw, trans_a=True, beta=1.0, tf32=self.config.tf32)
        if self.bias_term and self.get_param_propagate_down(1):
            db = self.blobs[1].mutable_diff_for(xp)
            if xp is np:
                db += dy.sum(axis=0)
            else:  # a GEMV with a ones vector: cuBLAS, deterministic, no temporary
                gemm(xp, self._ones(xp), dy, db.reshape(1, self.N), beta=1.0,
                     tf32=self.config.tf32)
        if propagate_down[0]:
            w = self.blobs[0].data_for(xp)
            dx = bottom[0].mutable_diff_for(xp).reshape(self.M, self.K)
            gemm(xp, dy, w, dx, trans_b=self.transpose, tf32=self.config.tf32)

    retain_inputs, retain_outputs = (0,), ()

    # -- on 2-byte buffers (real 16-bit storage, engine/precision.py): cuBLAS GemmEx with
    # fp32 accumulation; the weights cast to the reduced type (a shared scratch), the
    # weight gradient accumulated into the fp32 master diff
    reduced_body = True

    def reduced_weights(self, storage, nhwc=False):
        """(bytes, kept) of the weights the 2-byte body casts to ``storage``'s type: at
        each forward and backward call, not kept between them (the memory plan gives each
        call's copy a place in its arena, live at that op only: engine/plan.py)."""
        from ..core.precision import buffer_dtype
        return self.blobs[0].count() * np.dtype(buffer_dtype(storage)).itemsize, False

    def _w16(self, s, direction):
        """The weights cast to ``s``'s type for this ``direction``'s call: into the place
        the memory plan gave that copy (``planned_workspace[direction + " weights"]``),
        else into a scratch buffer shared by every layer."""
        from ..kernels.precision import to_reduced
        from ..core.precision import buffer_dtype
        from .cudnn_layers import scratch
        w = self.blobs[0].gpu_data()
        dt = np.dtype(buffer_dtype(s))
        n = w.size * dt.itemsize
        places = getattr(self, "planned_workspace", None) or {}
        view = places.get(CAST_WEIGHTS)
        if view is not None and self._step_cast == s and view.nbytes >= n:
            return view[:n].view(dt).reshape(w.shape)   # the step's one launch cast it
        view = places.get(CAST_WEIGHTS, places.get(direction + " weights"))
        buf = view if view is not None and view.nbytes >= n else scratch("w16", n)
        return to_reduced(w, buf[:n].view(dt).reshape(w.shape), s)

    def weight_copy_dims(self):
        """(k, c, rs) of the copy ``reduced_weights`` counts: the weights' own shape
        (1, count, 1) (kernels/wcast.py casts it so)."""
        return 1, self.blobs[0].count(), 1

    def forward_gpu(self, bottom, top):
        from ..kernels import reduced
        s = reduced.storage(bottom[0])
        if s is None or reduced.storage(top[0]) != s:
            return super().forward_gpu(bottom, top)
        from ..gpu.cublas import matmul_ex
        x = bottom[0].gpu_data().reshape(self.M, self.K)
        y = top[0].mutable_gpu_data().reshape(self.M, self.N)
        matmul_ex(x, self._w16(s, "forward"), y, trans_b=not self.transpose)
        if self.bias_term:
            reduced.bias_act(y, s, bias=self.blobs[1].gpu_data())

    def backward_gpu(self, top, propagate_down, bottom):
        from ..kernels import reduced
        s = reduced.storage(top[0], diff=True)
        if s is None or reduced.storage(bottom[0]) != s or (
                propagate_down[0] and reduced.storage(bottom[0], diff=True) != s):
            return super().backward_gpu(top, propagate_down, bottom)
        from ..gpu.cublas import matmul_ex
        dy = top[0].gpu_diff().reshape(self.M, self.N)
        x = bottom[0].gpu_data().reshape(self.M, self.K)
        if self.get_param_propagate_down(0):
            dw = self.blobs[0].mutable_gpu_diff()
            if self.transpose:
                matmul_ex(x, dy, dw, trans_a=True, beta=1.0)
            else:
                matmul_ex(dy, x, dw, trans_a=True, beta=1.0)
        if self.bias_term and self.get_param_propagate_down(1):
            from ..kernels.reduce import partial_size
            n = partial_size(self.M, self.N)
            p = getattr(self, "_partial16", None)
            if p is None or p.size < n:
                p = self._partial16 = backend.gpu_module().empty(n, dtype=np.float64)
            reduced.channel_sum(dy, self.blobs[1].mutable_gpu_diff(), p, s)
        if propagate_down[0]:
            dx = bottom[0].mutable_gpu_diff().reshape(self.M, self.K)
            matmul_ex(dy, self._w16(s, "backward"), dx, trans_b=self.transpose)

    def _ones(self, xp):
        o = getattr(self, "_ones_arr", None)
        if o is None or o.shape != (1, self.M) or not isinstance(o, xp.ndarray):
            o = self._ones_arr = xp.ones((1, self.M), dtype=self.blobs[0].dtype)
        return o


@register_layer("Split")
class SplitLayer(Layer):
    """Copies one bottom to several tops (sharing its data); the bottom's diff is
    the sum of the tops' diffs."""
    capturable = True

    retain_inputs, retain_outputs = (), ()
    exact_num_bottom_blobs = 1
    min_top_blobs = 1

    def reshape(self, bottom, top):
        for i, t in enumerate(top):
            if t is bottom[0]:
                raise self.error(f"top {i} cannot be computed in place")
            t.reshape(bottom[0].shape)
            t.share_data(bottom[0])

    @property
    def reduced_body(self):
        """On 2-byte buffers (engine/precision.py) for one or two tops."""
        return len(self.layer_param.top) <= 2

    def forward_xp(self, xp, bottom, top):
        pass

    def backward_gpu(self, top, propagate_down, bottom):
        from ..kernels import reduced
        s = reduced.storage(bottom[0], diff=True)
        if s is None or not propagate_down[0]:
            return super().backward_gpu(top, propagate_down, bottom)
        dx = bottom[0].mutable_gpu_diff()
        if len(top) == 1:
            dx[...] = top[0].gpu_diff()
        else:
            reduced.add(top[0].gpu_diff(), top[1].gpu_diff(), dx, s)

    def backward_xp(self, xp, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        dx = bottom[0].mutable_diff_for(xp)
        if len(top) == 1:
            dx[...] = top[0].diff_for(xp)
            return
        xp.add(top[0].diff_for(xp), top[1].diff_for(xp), out=dx)   # one pass for two tops
        for t in top[2:]:
            dx += t.diff_for(xp)


def softmax(xp, x, axis):
    m = x.max(axis=axis, keepdims=True)
    e = xp.exp(x - m)
    e /= e.sum(axis=axis, keepdims=True)
    return e


@register_layer("Softmax")
class SoftmaxLayer(Layer):
    """Softmax over ``axis`` (default 1).  dx = y * (dy - sum(dy * y, axis))."""
    capturable = True
    exact_num_bottom_blobs = 1
    exact_num_top_blobs = 1

    def reshape(self, bottom, top):
        self.axis = _canonical(self, bottom[0], self.layer_param.softmax_param.axis)
        top[0].reshape(bottom[0].shape)

    retain_inputs, retain_outputs = (), (0,)

    def forward_xp(self, xp, bottom, top):
        top[0].mutable_data_for(xp)[...] = softmax(xp, bottom[0].data_for(xp), self.axis)

    def backward_xp(self, xp, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        y = top[0].data_for(xp)
        dy = top[0].diff_for(xp)
        dot = (dy * y).sum(axis=self.axis, keepdims=True)
        bottom[0].mutable_diff_for(xp)[...] = (dy - dot) * y


@register_layer("Embed")
class EmbedLayer(Layer):
    """A learned lookup table: bottom holds integer indices in [0, input_dim) of
    any shape; top has shape bottom.shape + (num_output,).
    y[n] = W[i_n] (+ b), W is (input_dim, num_output);
    dW[i] += sum of dy[n] over the n with i_n == i;  db += sum of dy.
    The indices get no gradient."""
    exact_num_bottom_blobs = 1
    exact_num_top_blobs = 1

    def layer_setup(self, bottom, top):
        p = self.layer_param.embed_param
        self.N, self.K = int(p.num_output), int(p.input_dim)
        if self.N <= 0:
            raise self.error(f"num_output must be positive, got {self.N}")
        if self.K <= 0:
            raise self.error(f"input_dim must be positive, got {self.K}")
        self.bias_term = p.bias_term
        want = [(self.K, self.N)] + ([(self.N,)] if self.bias_term else [])
        if self.blobs:
            got = [b.shape for b in self.blobs]
            if got != want:
                raise self.error(f"parameter blobs {got} do not match {want}")
            return
        dtype = bottom[0].dtype
        self.blobs = [Blob(want[0], dtype)]
        fill(self.blobs[0], p.weight_filler)
        if self.bias_term:
            self.blobs.append(Blob(want[1], dtype))
            fill(self.blobs[1], p.bias_filler)

    def reshape(self, bottom, top):
        top[0].reshape(bottom[0].shape + (self.N,))

    def forward_xp(self, xp, bottom, top):
        idx = _indices(self, xp, bottom[0].data_for(xp), self.K, "embed indices (bottom 0)")
        y = top[0].mutable_data_for(xp).reshape(-1, self.N)
        y[...] = self.blobs[0].data_for(xp)[idx.reshape(-1)]
        if self.bias_term:
            y += self.blobs[1].data_for(xp)

    def backward_xp(self, xp, top, propagate_down, bottom):
        if propagate_down[0]:
            raise self.error("cannot backpropagate to the indices (bottom 0)")
        dy = top[0].diff_for(xp).reshape(-1, self.N)
        if self.get_param_propagate_down(0):
            idx = bottom[0].data_for(xp).reshape(-1).astype(np.int64)
            _scatter_add(xp, self.blobs[0].mutable_diff_for(xp), idx, dy)
        if self.bias_term and self.get_param_propagate_down(1):
            self.blobs[1].mutable_diff_for(xp)[...] += dy.sum(axis=0)

    def allow_force_backward(self, bottom_index):
        return False


def _axis_or_legacy(layer, blob, p, legacy_name):
    """Concat's/Slice's axis: the deprecated ``concat_dim``/``slice_dim`` when given
    (no negative indexing), else ``axis`` (may be negative)."""
    if p.HasField("axis") and p.HasField(legacy_name):
        raise layer.error(f"either axis or {legacy_name} should be specified; not both")
    if p.HasField(legacy_name):
        axis = getattr(p, legacy_name)
        if axis >= blob.num_axes:
            raise layer.error(f"{legacy_name} {axis} is out of range for bottom shape {blob.shape}")
        return axis
    return _canonical(layer, blob, p.axis)


def _along(axis, start, stop):
    return (slice(None),) * axis + (slice(start, stop),)


@register_layer("Concat")
class ConcatLayer(Layer):
    """Joins the bottoms along ``axis`` (default 1, the channels); every other
    dimension must agree.  dx_i = the matching slice of dy.  One bottom: the top
    shares its data and diff."""
    capturable = True

    retain_inputs, retain_outputs = (), ()
    min_bottom_blobs = 1
    exact_num_top_blobs = 1

    def reshape(self, bottom, top):
        p = self.layer_param.concat_param
        b0 = bottom[0]
        self.axis = axis = _axis_or_legacy(self, b0, p, "concat_dim")
        for i, b in enumerate(bottom[1:], 1):
            if b.num_axes != b0.num_axes:
                raise self.error(f"all bottoms must have the same number of axes: bottom 0 "
                                 f"{b0.shape}, bottom {i} {b.shape}")
            if b.shape[:axis] != b0.shape[:axis] or b.shape[axis + 1:] != b0.shape[axis + 1:]:
                raise self.error(f"all bottoms must have the same shape except on the concat "
                                 f"axis {axis}: bottom 0 {b0.shape}, bottom {i} {b.shape}")
        shape = list(b0.shape)
        shape[axis] = sum(b.shape[axis] for b in bottom)
        top[0].reshape(shape)
        if len(bottom) == 1:
            top[0].share_data(b0)
            top[0].share_diff(b0)

    def forward_xp(self, xp, bottom, top):
        if len(bottom) == 1:
            return
        y = top[0].mutable_data_for(xp)
        o = 0
        for b in bottom:
            n = b.shape[self.axis]
            y[_along(self.axis, o, o + n)] = b.data_for(xp)
            o += n

    def backward_xp(self, xp, top, propagate_down, bottom):
        if len(bottom) == 1:
            return
        dy = top[0].diff_for(xp)
        o = 0
        for i, b in enumerate(bottom):
            n = b.shape[self.axis]
            if propagate_down[i]:
                b.mutable_diff_for(xp)[...] = dy[_along(self.axis, o, o + n)]
            o += n


@register_layer("Slice")
class SliceLayer(Layer):
    """Cuts the bottom along ``axis`` (default 1) at the ``slice_point``s (strictly
    increasing, inside the axis; one fewer than the tops), or into equal parts
    when none are given.  dx = the tops' diffs joined back.  One top: it shares
    the bottom's data and diff."""
    capturable = True

    retain_inputs, retain_outputs = (), ()
    exact_num_bottom_blobs = 1
    min_top_blobs = 1

    def reshape(self, bottom, top):
        p = self.layer_param.slice_param
        b = bottom[0]
        self.axis = axis = _axis_or_legacy(self, b, p, "slice_dim")
        n = b.shape[axis]
        points = [int(s) for s in p.slice_point]
        if points:
            if len(points) != len(top) - 1:
                raise self.error(f"{len(points)} slice_point(s) given for {len(top)} tops; "
                                 f"needs {len(top) - 1}")
            prev, sizes = 0, []
            for s in points:
                if s <= prev:
                    raise self.error(f"slice points must be strictly increasing and positive, "
                                     f"got {points}")
                sizes.append(s - prev)
                prev = s
            if prev >= n:
                raise self.error(f"slice point {prev} is out of range for axis {axis} of size "
                                 f"{n} (bottom {b.shape})")
            sizes.append(n - prev)
        else:
            if n % len(top):
                raise self.error(f"axis {axis} of size {n} (bottom {b.shape}) cannot be split "
                                 f"evenly into {len(top)} tops; give slice_point")
            sizes = [n // len(top)] * len(top)
        self.sizes = sizes
        shape = list(b.shape)
        for t, s in zip(top, sizes):
            shape[axis] = s
            t.reshape(shape)
        if len(top) == 1:
            top[0].share_data(b)
            top[0].share_diff(b)

    def forward_xp(self, xp, bottom, top):
        if len(top) == 1:
            return
        x = bottom[0].data_for(xp)
        o = 0
        for t, s in zip(top, self.sizes):
            t.mutable_data_for(xp)[...] = x[_along(self.axis, o, o + s)]
            o += s

    def backward_xp(self, xp, top, propagate_down, bottom):
        if len(top) == 1 or not propagate_down[0]:
            return
        dx = bottom[0].mutable_diff_for(xp)
        o = 0
        for t, s in zip(top, self.sizes):
            dx[_along(self.axis, o, o + s)] = t.diff_for(xp)
            o += s


_PROD = caffe_pb2.EltwiseParameter.PROD
_SUM = caffe_pb2.EltwiseParameter.SUM
_MAX = caffe_pb2.EltwiseParameter.MAX


def _add_relu():
    from ..kernels._backend import elementwise_kernel
    return elementwise_kernel("T a, T b", "T y", "T s = a + b; y = s > (T)0 ? s : (T)0",
                              "mc_add_relu")


def _relu_grad1():
    from ..kernels._backend import elementwise_kernel
    return elementwise_kernel("T y, T dy", "T dx", "dx = y > (T)0 ? dy : (T)0", "mc_relu_grad1")


def _relu_grad2():
    from ..kernels._backend import elementwise_kernel
    return elementwise_kernel("T y, T dy", "T d0, T d1",
                              "T d = y > (T)0 ? dy : (T)0; d0 = d; d1 = d", "mc_relu_grad2")


@register_layer("Eltwise")
class EltwiseLayer(Layer):
    """Elementwise over bottoms of one shape: PROD (y = prod x_i), SUM (y = sum c_i x_i,
    ``coeff`` default 1) or MAX (y = max x_i; ties go to the first bottom).
    PROD: dx_i = dy * prod_{j != i} x_j (``stable_prod_grad``) or dy * y / x_i;
    SUM: dx_i = c_i dy;  MAX: dx_i = dy where bottom i was the max, else 0."""
    capturable = True
    min_bottom_blobs = 2
    exact_num_top_blobs = 1

    def layer_setup(self, bottom, top):
        p = self.layer_param.eltwise_param
        self.op = p.operation
        if len(p.coeff) and self.op != _SUM:
            raise self.error("coeff is only for the SUM operation")
        if len(p.coeff) and len(p.coeff) != len(bottom):
            raise self.error(f"takes one coeff per bottom blob: {len(p.coeff)} coeff(s) for "
                             f"{len(bottom)} bottoms")
        self.coeffs = [float(c) for c in p.coeff] or [1.0] * len(bottom)
        self.stable = p.stable_prod_grad
        self._saved = None

    def reshape(self, bottom, top):
        for i, b in enumerate(bottom[1:], 1):
            if b.shape != bottom[0].shape:
                raise self.error(f"all bottoms must have the same shape: bottom 0 "
                                 f"{bottom[0].shape}, bottom {i} {b.shape}")
        top[0].reshape(bottom[0].shape)

    def forward_xp(self, xp, bottom, top):
        xs = [b.data_for(xp) for b in bottom]
        in_place = any(top[0] is b for b in bottom)
        if self.op == _PROD:
            self._saved = [x.copy() for x in xs] if in_place else None
            y = xs[0] * xs[1]
            for x in xs[2:]:
                y *= x
        elif self.op == _SUM and not in_place and all(c == 1 for c in self.coeffs):
            y = top[0].mutable_data_for(xp)      # one pass per operand, written in place
            xp.add(xs[0], xs[1], out=y)
            for x in xs[2:]:
                y += x
            return
        elif self.op == _SUM:
            y = xs[0] * xs[0].dtype.type(self.coeffs[0])
            for c, x in zip(self.coeffs[1:], xs[1:]):
                y += x * x.dtype.type(c)
        else:
            y = xs[0].copy()
            arg = xp.zeros(y.shape, dtype=np.int32)
            for i, x in enumerate(xs[1:], 1):
                better = x > y
                y = xp.where(better, x, y)
                arg = xp.where(better, np.int32(i), arg)
            self._argmax = arg
        top[0].mutable_data_for(xp)[...] = y

    # The fused type Eltwise+ReLU (layers/fused.py): a plain ReLU in place on the top
    # right after a SUM of two bottoms with unit coefficients (ResNet's y = relu(a + b)),
    # forward in one pass, backward the mask applied while copying dy to the bottoms.
    def _fusable(self, bottom, top):
        return (self.op == _SUM and all(c == 1 for c in self.coeffs) and len(bottom) == 2
                and not any(top[0] is b for b in bottom))

    def forward_gpu_relu(self, bottom, top):
        """y = relu(a + b) in one pass; False, with nothing done, where this is not a
        SUM of two bottoms with unit coefficients, out of place."""
        if not self._fusable(bottom, top):
            return False
        from ..kernels import reduced
        s = reduced.storage(bottom[0])
        if s is not None:
            reduced.add(bottom[0].gpu_data(), bottom[1].gpu_data(), top[0].mutable_gpu_data(),
                        s, relu=True)
            return True
        _add_relu()(bottom[0].gpu_data(), bottom[1].gpu_data(), top[0].mutable_gpu_data())
        return True

    # on 2-byte buffers (real 16-bit storage, engine/precision.py): the SUM of two bottoms
    # with unit coefficients, out of place (ResNet's), alone or fused with its ReLU
    @property
    def reduced_body(self):
        p = self.layer_param
        return (self.op == _SUM and all(c == 1 for c in self.coeffs) and len(p.bottom) == 2
                and not set(p.top) & set(p.bottom))

    def forward_gpu(self, bottom, top):
        from ..kernels import reduced
        s = reduced.storage(bottom[0])
        if s is None:
            return super().forward_gpu(bottom, top)
        reduced.add(bottom[0].gpu_data(), bottom[1].gpu_data(), top[0].mutable_gpu_data(), s)

    def backward_gpu(self, top, propagate_down, bottom):
        from ..kernels import reduced
        if reduced.storage(top[0], diff=True) is None:
            return super().backward_gpu(top, propagate_down, bottom)
        dy = top[0].gpu_diff()
        for i, b in enumerate(bottom):
            if propagate_down[i]:
                b.mutable_gpu_diff()[...] = dy

    def backward_gpu_relu(self, top, propagate_down, bottom):
        """The backward of Eltwise+ReLU: dx_i = dy where y > 0, else 0 (reads y)."""
        y, dy = top[0].gpu_data(), top[0].gpu_diff()
        outs = [b.mutable_gpu_diff() if propagate_down[i] else None
                for i, b in enumerate(bottom)]
        from ..kernels import reduced
        s = reduced.storage(top[0], diff=True)
        if s is not None:
            for o in outs:
                if o is not None:
                    reduced.relu_backward(y, dy, o, s)
            return
        if outs[0] is not None and outs[1] is not None:
            _relu_grad2()(y, dy, outs[0], outs[1])
        else:
            for o in outs:
                if o is not None:
                    _relu_grad1()(y, dy, o)

    # backward of SUM reads nothing (fused with a ReLU: its top, declared by the fused
    # type); PROD and MAX read their inputs and top (PROD keeps copies only in place)
    @property
    def retain_inputs(self):
        return () if self.op == _SUM else None

    @property
    def retain_outputs(self):
        return () if self.op == _SUM else None

    def state_bytes(self, bottom, top):
        n = bottom[0].count() * bottom[0].dtype.itemsize
        if self.op == _MAX:
            return bottom[0].count() * 4           # the int32 argmax
        if self.op == _PROD and any(top[0] is b for b in bottom):
            return n * len(bottom)                 # the saved inputs
        return 0

    def backward_xp(self, xp, top, propagate_down, bottom):
        dy = top[0].diff_for(xp)
        if any(top[0] is b for b in bottom):
            dy = dy.copy()  # in place, the first bottom diff written overwrites dy
        for i, b in enumerate(bottom):
            if not propagate_down[i]:
                continue
            if self.op == _PROD:
                xs = self._saved or [bb.data_for(xp) for bb in bottom]
                if self.stable:
                    g = None
                    for j, x in enumerate(xs):
                        if j != i:
                            g = x.copy() if g is None else g * x
                else:
                    with np.errstate(all="ignore"):
                        y = top[0].data_for(xp) if self._saved is None else self._prod(xs)
                        g = y / xs[i]
                d = dy * g
            elif self.op == _SUM:
                c = self.coeffs[i]
                d = dy if c == 1 else dy * dy.dtype.type(c)
            else:
                d = dy * (self._argmax == i)
            b.mutable_diff_for(xp)[...] = d

    @staticmethod
    def _prod(xs):
        y = xs[0] * xs[1]
        for x in xs[2:]:
            y = y * x
        return y


@register_layer("Flatten")
class FlattenLayer(Layer):
    """Merges axes [axis, end_axis] (default 1 to -1) into one: (N, C, H, W) ->
    (N, C*H*W).  The top shares the bottom's data and diff."""
    capturable = True

    retain_inputs, retain_outputs = (), ()
    exact_num_bottom_blobs = 1
    exact_num_top_blobs = 1

    def layer_setup(self, bottom, top):
        if top[0] is bottom[0]:
            raise self.error("does not allow in-place computation")

    def reshape(self, bottom, top):
        p = self.layer_param.flatten_param
        b = bottom[0]
        start = _canonical(self, b, p.axis)
        end = _canonical(self, b, p.end_axis, "end_axis")
        if end < start:
            raise self.error(f"end_axis {p.end_axis} comes before axis {p.axis} for bottom "
                             f"shape {b.shape}")
        top[0].reshape(b.shape[:start] + (b.count(start, end + 1),) + b.shape[end + 1:])
        top[0].share_data(b)
        top[0].share_diff(b)

    reduced_body = True     # shares its bottom's buffers, whatever their type

    def forward_xp(self, xp, bottom, top):
        pass


@register_layer("Reshape")
class ReshapeLayer(Layer):
    """Gives the bottom a new shape of the same count: ``shape`` replaces bottom
    axes [axis, axis + num_axes) (default all); a 0 copies the bottom's dimension
    at that place, one -1 is inferred.  The top shares the bottom's data and diff."""
    capturable = True

    retain_inputs, retain_outputs = (), ()
    exact_num_bottom_blobs = 1
    exact_num_top_blobs = 1

    def layer_setup(self, bottom, top):
        if top[0] is bottom[0]:
            raise self.error("does not allow in-place computation")
        dims = [int(d) for d in self.layer_param.reshape_param.shape.dim]
        self.copy_axes = [i for i, d in enumerate(dims) if d == 0]
        inferred = [i for i, d in enumerate(dims) if d == -1]
        if len(inferred) > 1:
            raise self.error(f"new shape {dims} contains multiple -1 dims; at most a single "
                             f"(1) value of -1 may be specified")
        if any(d < -1 for d in dims):
            raise self.error(f"new shape {dims} has a dimension below -1")
        self.inferred_axis = inferred[0] if inferred else -1
        self.constant_count = 1
        for d in dims:
            if d > 0:
                self.constant_count *= d
        self.dims = dims

    def reshape(self, bottom, top):
        p = self.layer_param.reshape_param
        b = bottom[0]
        nax = b.num_axes
        start = p.axis if p.axis >= 0 else nax + p.axis + 1
        if not 0 <= start <= nax:
            raise self.error(f"axis {p.axis} is out of range for bottom shape {b.shape}")
        if p.num_axes < -1:
            raise self.error(f"num_axes must be >= 0, or -1 for all; got {p.num_axes}")
        end = nax if p.num_axes == -1 else start + p.num_axes
        if end > nax:
            raise self.error(f"axis + num_axes = {end} is out of range for bottom shape {b.shape}")
        shape = list(b.shape[:start]) + list(self.dims) + list(b.shape[end:])
        for i in self.copy_axes:
            if start + i >= nax:
                raise self.error(f"new shape {self.dims} contains a 0 at position {i}, but bottom "
                                 f"shape {b.shape} has no axis {start + i} to copy")
            shape[start + i] = b.shape[start + i]
        if self.inferred_axis >= 0:
            explicit = self.constant_count * b.count(0, start) * b.count(end)
            for i in self.copy_axes:
                explicit *= shape[start + i]
            if explicit == 0 or b.count() % explicit:
                raise self.error(f"bottom count {b.count()} (shape {b.shape}) must be divisible "
                                 f"by the product of the specified dimensions ({explicit})")
            shape[start + self.inferred_axis] = b.count() // explicit
        count = int(np.prod(shape, dtype=np.int64))
        if count != b.count():
            raise self.error(f"output count {count} (shape {tuple(shape)}) must match input "
                             f"count {b.count()} (shape {b.shape})")
        top[0].reshape(shape)
        top[0].share_data(b)
        top[0].share_diff(b)

    reduced_body = True     # shares its bottom's buffers, whatever their type

    def forward_xp(self, xp, bottom, top):
        pass


@register_layer("Tile")
class TileLayer(Layer):
    """Repeats the bottom ``tiles`` times along ``axis`` (the whole block from
    ``axis`` on is repeated: (N, C) tiled 2x on axis 1 is (N, [C, C])).
    dx = the sum of dy over the copies."""
    exact_num_bottom_blobs = 1
    exact_num_top_blobs = 1

    def layer_setup(self, bottom, top):
        if top[0] is bottom[0]:
            raise self.error("does not allow in-place computation")
        p = self.layer_param.tile_param
        if not p.HasField("tiles"):
            raise self.error("tile_param { tiles: ... } must be specified")
        if p.tiles < 1:
            raise self.error(f"tiles must be positive, got {p.tiles}")
        self.tiles = int(p.tiles)

    def reshape(self, bottom, top):
        b = bottom[0]
        axis = _canonical(self, b, self.layer_param.tile_param.axis)
        shape = list(b.shape)
        shape[axis] *= self.tiles
        top[0].reshape(shape)
        self.outer, self.inner = b.count(0, axis), b.count(axis)

    def forward_xp(self, xp, bottom, top):
        x = bottom[0].data_for(xp).reshape(self.outer, 1, self.inner)
        top[0].mutable_data_for(xp).reshape(self.outer, self.tiles, self.inner)[...] = x

    def backward_xp(self, xp, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        dy = top[0].diff_for(xp).reshape(self.outer, self.tiles, self.inner)
        bottom[0].mutable_diff_for(xp).reshape(self.outer, self.inner)[...] = dy.sum(axis=1)


_R = caffe_pb2.ReductionParameter


@register_layer("Reduction")
class ReductionLayer(Layer):
    """Reduces all axes from ``axis`` (default 0: everything, a scalar top) with
    SUM, ASUM (sum |x|), SUMSQ (sum x^2) or MEAN, times ``coeff``: top shape is
    bottom.shape[:axis].  dx = coeff * dy * (1, sign(x), 2x, 1/dim)."""
    exact_num_bottom_blobs = 1
    exact_num_top_blobs = 1

    def reshape(self, bottom, top):
        p = self.layer_param.reduction_param
        b = bottom[0]
        axis = _canonical(self, b, p.axis) if b.num_axes else 0
        top[0].reshape(b.shape[:axis])
        self.num, self.dim = b.count(0, axis), b.count(axis)
        self.op = p.operation
        self.coeff = float(p.coeff)
        if self.op == _R.MEAN and self.dim:
            self.coeff /= self.dim

    def forward_xp(self, xp, bottom, top):
        x = bottom[0].data_for(xp).reshape(self.num, self.dim)
        if self.op == _R.ASUM:
            r = xp.abs(x).sum(axis=1)
        elif self.op == _R.SUMSQ:
            r = (x * x).sum(axis=1)
        else:  # SUM, MEAN
            r = x.sum(axis=1)
        top[0].mutable_data_for(xp).reshape(self.num)[...] = r * x.dtype.type(self.coeff)

    def backward_xp(self, xp, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        x = bottom[0].data_for(xp).reshape(self.num, self.dim)
        g = top[0].diff_for(xp).reshape(self.num, 1) * x.dtype.type(self.coeff)
        dx = bottom[0].mutable_diff_for(xp).reshape(self.num, self.dim)
        if self.op == _R.ASUM:
            dx[...] = g * xp.sign(x)
        elif self.op == _R.SUMSQ:
            dx[...] = g * 2 * x
        else:
            dx[...] = g


@register_layer("ArgMax")
class ArgMaxLayer(Layer):
    """The indices (or with ``out_max_val`` the values) of the ``top_k`` largest
    entries.  With ``axis``: along that axis, top = bottom with that axis cut to
    top_k.  Without: over each item's flattened data, top is (N, 1, top_k) or
    (N, 2, top_k) with indices then values for out_max_val (at least 3 axes).
    Ties: the larger index first (Caffe's sort of (value, index) pairs).
    No gradient."""
    exact_num_bottom_blobs = 1
    exact_num_top_blobs = 1

    def layer_setup(self, bottom, top):
        p = self.layer_param.argmax_param
        self.out_max_val = p.out_max_val
        self.top_k = int(p.top_k)
        self.has_axis = p.HasField("axis")
        if self.top_k < 1:
            raise self.error(f"top_k must not be less than 1, got {self.top_k}")

    def reshape(self, bottom, top):
        p = self.layer_param.argmax_param
        b = bottom[0]
        if self.has_axis:
            self.axis = _canonical(self, b, p.axis)
            if self.top_k > b.shape[self.axis]:
                raise self.error(f"top_k {self.top_k} must be less than or equal to the dimension "
                                 f"of axis {self.axis} of bottom shape {b.shape}")
            shape = list(b.shape)
            shape[self.axis] = self.top_k
        else:
            if b.num_axes < 1 or self.top_k > b.count(1):
                raise self.error(f"top_k {self.top_k} must be less than or equal to the size of "
                                 f"one item of bottom shape {b.shape}")
            shape = [1] * max(b.num_axes, 3)
            shape[0] = b.shape[0]
            shape[2] = self.top_k
            if self.out_max_val:
                shape[1] = 2
        top[0].reshape(shape)

    def forward_xp(self, xp, bottom, top):
        x = bottom[0].data_for(xp)
        k = self.top_k
        if self.has_axis:
            xm = xp.moveaxis(x, self.axis, -1)
        else:
            xm = x.reshape(x.shape[0], -1)
        dim = xm.shape[-1]
        # descending by value, ties by the larger index: a stable ascending sort of
        # the negated values, taken over the reversed axis
        order = xp.argsort(-xm[..., ::-1], axis=-1, kind="stable")[..., :k]
        idx = (dim - 1) - order
        vals = xp.take_along_axis(xm, idx, axis=-1)
        y = top[0].mutable_data_for(xp)
        if self.has_axis:
            out = vals if self.out_max_val else idx.astype(x.dtype)
            y[...] = xp.moveaxis(out, -1, self.axis)
        elif self.out_max_val:
            y2 = y.reshape(x.shape[0], 2, k)
            y2[:, 0] = idx
            y2[:, 1] = vals
        else:
            y.reshape(x.shape[0], k)[...] = idx


@register_layer("Silence")
class SilenceLayer(Layer):
    """Consumes its bottoms (so they are not net outputs) and makes no top; backward
    writes zero diffs."""
    capturable = True

    retain_inputs, retain_outputs = (), ()
    min_bottom_blobs = 1
    exact_num_top_blobs = 0

    def reshape(self, bottom, top):
        pass

    def forward_xp(self, xp, bottom, top):
        pass

    def backward_xp(self, xp, top, propagate_down, bottom):
        for i, b in enumerate(bottom):
            if propagate_down[i]:
                b.mutable_diff_for(xp)[...] = 0


@register_layer("Filter")
class FilterLayer(Layer):
    """Keeps the items (first-axis entries) whose selector is non-zero.  Bottoms:
    k blobs to filter, then the selector (N, 1, ...); tops: the k filtered blobs.
    At setup the tops have the full batch (the selector is not known yet).
    dx = dy for the kept items, 0 for the others; the selector gets no gradient."""
    min_bottom_blobs = 2
    min_top_blobs = 1

    def layer_setup(self, bottom, top):
        if len(top) != len(bottom) - 1:
            raise self.error(f"needs one top per filtered bottom: {len(bottom) - 1} bottoms to "
                             f"filter (plus the selector), {len(top)} tops")
        self._n_bottom = len(bottom)
        self._first = True
        self._keep = None

    def reshape(self, bottom, top):
        sel = bottom[-1]
        if sel.num_axes < 1 or any(d != 1 for d in sel.shape[1:]):
            raise self.error(f"selector (last bottom) must have singleton dimensions except the "
                             f"first, got shape {sel.shape}")
        for i, b in enumerate(bottom[:-1]):
            if b.num_axes < 1 or b.shape[0] != sel.shape[0]:
                raise self.error(f"bottom {i} {b.shape} must have the selector's first "
                                 f"dimension {sel.shape[0]}")
        self._keep = np.flatnonzero(sel.cpu_data().reshape(-1))
        n = sel.shape[0] if self._first else len(self._keep)
        self._first = False
        for t, b in zip(top, bottom):
            t.reshape((n,) + b.shape[1:])

    def forward_xp(self, xp, bottom, top):
        keep = xp.asarray(self._keep)
        for t, b in zip(top, bottom):
            t.mutable_data_for(xp)[...] = b.data_for(xp)[keep]

    def backward_xp(self, xp, top, propagate_down, bottom):
        if propagate_down[-1]:
            raise self.error("cannot backpropagate to the selector (last bottom)")
        keep = xp.asarray(self._keep)
        for i, (t, b) in enumerate(zip(top, bottom)):
            if propagate_down[i]:
                dx = b.mutable_diff_for(xp)
                dx[...] = 0
                dx[keep] = t.diff_for(xp)

    def allow_force_backward(self, bottom_index):
        return bottom_index != self._n_bottom - 1


@register_layer("BatchReindex")
class BatchReindexLayer(Layer):
    """Gathers items of bottom 0 by the indices in bottom 1 (1-D): top[i] = x[p_i],
    top shape (len(p),) + x.shape[1:].  dx[j] = sum of dy[i] over the i with p_i == j;
    the indices get no gradient."""
    exact_num_bottom_blobs = 2
    exact_num_top_blobs = 1

    def reshape(self, bottom, top):
        if bottom[1].num_axes != 1:
            raise self.error(f"the index bottom (bottom 1) must be 1-D, got shape {bottom[1].shape}")
        if bottom[0].num_axes < 1:
            raise self.error(f"bottom 0 needs a first axis to index, got shape {bottom[0].shape}")
        top[0].reshape(bottom[1].shape[:1] + bottom[0].shape[1:])

    def forward_xp(self, xp, bottom, top):
        idx = _indices(self, xp, bottom[1].data_for(xp), bottom[0].shape[0],
                       "reindex indices (bottom 1)")
        top[0].mutable_data_for(xp)[...] = bottom[0].data_for(xp)[idx]

    def backward_xp(self, xp, top, propagate_down, bottom):
        if propagate_down[1]:
            raise self.error("cannot backpropagate to the indices (bottom 1)")
        if not propagate_down[0]:
            return
        idx = bottom[1].data_for(xp).astype(np.int64)
        dx = bottom[0].mutable_diff_for(xp)
        dx[...] = 0
        _scatter_add(xp, dx, idx, top[0].diff_for(xp))

    def allow_force_backward(self, bottom_index):
        return bottom_index == 0


@register_layer("Parameter")
class ParameterLayer(Layer):
    """No bottoms; its one param blob (``parameter_param { shape }``, zeros until
    trained or loaded) is the top: they share data and diff."""
    exact_num_bottom_blobs = 0
    exact_num_top_blobs = 1

    def layer_setup(self, bottom, top):
        shape = tuple(int(d) for d in self.layer_param.parameter_param.shape.dim)
        if self.blobs:
            if len(self.blobs) != 1 or self.blobs[0].shape != shape:
                raise self.error(f"parameter blobs {[b.shape for b in self.blobs]} do not match "
                                 f"the shape {shape}")
        else:
            self.blobs = [Blob(shape, top[0].dtype)]

    def reshape(self, bottom, top):
        top[0].reshape(self.blobs[0].shape)
        top[0].share_data(self.blobs[0])
        top[0].share_diff(self.blobs[0])

    def forward_xp(self, xp, bottom, top):
        pass
