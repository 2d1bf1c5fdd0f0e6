"""The vectorised 2-byte kernels (kernels/vec16.py, issue 20) give the generic
ElementwiseKernels' bits (``generic_kernel``: main's bodies, run on the same contiguous
arrays): ReLU forward/backward, add (+ReLU), bias_act (NCHW and NHWC), the casts fp32 <->
bf16/fp16 with from_reduced's modes, and the transposed casts, on sizes that take the 8-wide
path, the tail, misaligned views (4, 2, 1 wide) and several rounds of the grid-stride loop,
with NaN, inf, subnormal and signed-zero words.  Strided views take the generic bodies
(checked on words that are no fp32 subnormals: under CuPy's -ftz=true, whether a written
"v > 0" flushes a subnormal differs between compilations of one generic body,
benchmarks/ew16_bits.py).  bf16's cast is also checked against a numpy model of its
rounding."""
import numpy as np
import pytest

from minicaffe.core import precision as P
from minicaffe.kernels import precision as kp
from minicaffe.kernels import reduced

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy")

TYPES = [P.BFLOAT16, P.FLOAT16]
# (size, offset in elements): 8-wide with and without a tail, odd sizes, views at an
# offset of 1, 2, 4 elements (1, 2, 4 wide), and more vectors than one grid's threads
SIZES = [(8 * 4099, 0), (8 * 4099 + 5, 0), (1003, 0), (7, 0), (1001, 1), (1002, 2),
         (1004, 4), (2048 * 256 * 8 * 2 + 13, 0)]


def _words(n, seed):
    """n 2-byte words: every bit pattern (NaNs of both signs, infinities, subnormals,
    zeros) mixed with ordinary values of either sign."""
    rs = np.random.RandomState(seed)
    w = rs.randint(0, 1 << 16, size=n).astype(np.uint16)
    special = np.array([0x0000, 0x8000, 0x7f80, 0xff80, 0x7fc0, 0xffc1, 0x7c00, 0xfc00,
                        0x7e00, 0x0001, 0x8001, 0x3f80, 0xbf80], dtype=np.uint16)
    w[:min(n, special.size)] = special[:n]
    return w


def _floats(n, seed):
    """n fp32 values: random bit patterns (NaN payloads, inf, subnormals, beyond fp16's
    range), ties of both types' rounding, and normal values."""
    rs = np.random.RandomState(seed)
    a = rs.standard_normal(n).astype(np.float32) * 4
    bits = rs.randint(0, 1 << 32, size=n // 3, dtype=np.uint64).astype(np.uint32)
    a[:bits.size] = bits.view(np.float32)
    ties = (rs.randint(0, 1 << 16, size=n // 6).astype(np.uint32) << 16) | 0x8000
    a[n // 3:n // 3 + ties.size] = ties.view(np.float32)
    a[-min(n, 4):] = np.array([np.nan, np.inf, -np.inf, 70000.0], np.float32)[:min(n, 4)]
    return a


def _dtype(s):
    return kp.buffer_dtype(s)


def _dev(host, offset=0):
    """A contiguous device copy of ``host`` starting ``offset`` elements into its buffer."""
    buf = cp.empty(host.size + offset, dtype=host.dtype)
    a = buf[offset:]
    a[...] = cp.asarray(host)
    return a


def _strided(host):
    """A strided (not contiguous) device view holding ``host``: the generic kernels."""
    buf = cp.zeros((host.size, 2), dtype=host.dtype)
    v = buf[:, 0]
    v[...] = cp.asarray(host.ravel())
    assert not v.flags.c_contiguous
    return v


def _same(a, b):
    a, b = cp.asnumpy(a), cp.asnumpy(b)
    assert a.dtype == b.dtype and a.shape == b.shape
    assert np.array_equal(a.view(np.uint8), b.view(np.uint8))


def _w(host, s):
    return host.view(_dtype(s))


def _normal(w, s):
    """``w`` with bf16's subnormal words (fp32 subnormals once widened) made +-1."""
    if s == P.BFLOAT16:
        u = w.view(np.uint16).copy()
        sub = ((u & 0x7F80) == 0) & ((u & 0x7F) != 0)
        u[sub] = (u[sub] & 0x8000) | 0x3F80
        return u.view(w.dtype)
    return w


@pytest.mark.parametrize("s", TYPES)
@pytest.mark.parametrize("n,off", SIZES)
def test_relu_and_add_match_the_generic_kernels(s, n, off):
    x, d = _w(_words(n, 1), s), _w(_words(n, 2), s)
    dt = _dtype(s)
    gen = reduced.generic_kernel
    y, yg = _dev(np.zeros(n, dt), off), _dev(np.zeros(n, dt))
    reduced.relu_forward(_dev(x, off), y, s)
    gen(s, "relu_f")(_dev(x), yg)
    _same(y, yg)
    dx, dxg = _dev(np.zeros(n, dt), off), _dev(np.zeros(n, dt))
    reduced.relu_backward(_dev(x, off), _dev(d, off), dx, s)
    gen(s, "relu_b")(_dev(x), _dev(d), dxg)
    _same(dx, dxg)
    for relu in (False, True):
        o, og = _dev(np.zeros(n, dt), off), _dev(np.zeros(n, dt))
        reduced.add(_dev(x, off), _dev(d, off), o, s, relu=relu)
        gen(s, "add")(_dev(x), _dev(d), np.int32(relu), og)
        _same(o, og)


@pytest.mark.parametrize("s", TYPES)
def test_strided_views_take_the_generic_bodies(s):
    n = 8 * 1000 + 3
    x, d = _normal(_w(_words(n, 1), s), s), _normal(_w(_words(n, 2), s), s)
    dt = _dtype(s)
    for call in (lambda a, b, o: reduced.relu_forward(a, o, s),
                 lambda a, b, o: reduced.relu_backward(a, b, o, s),
                 lambda a, b, o: reduced.add(a, b, o, s, relu=True),
                 lambda a, b, o: reduced.bias_act(o, s, bias=cp.ones(1, np.float32),
                                                  relu=True)):
        o, og = _dev(x.copy()), _strided(x.copy())
        call(_dev(x), _dev(d), o)
        call(_strided(x), _strided(d), og)
        _same(o, og)
    h, hg = _dev(np.zeros(n, dt)), _strided(np.zeros(n, dt))
    xf = _floats(n, 3)
    kp.to_reduced(_dev(xf), h, s)
    kp.to_reduced(_strided(xf), hg, s)
    _same(h, hg)
    yf = np.abs(_floats(n, 4))
    yf[~np.isfinite(yf) | (yf < 1e-30)] = 1.0
    y, yg = _dev(yf), _strided(yf)
    kp.from_reduced(_dev(x), y, s, accumulate=True)
    kp.from_reduced(_strided(x), yg, s, accumulate=True)
    _same(y, yg)


def test_relu_forward_in_place():
    s = P.BFLOAT16
    x = _words(8 * 1000 + 3, 3)
    a = _dev(x)
    reduced.relu_forward(a, a, s)
    g = _dev(np.zeros_like(x))
    reduced.generic_kernel(s, "relu_f")(_dev(x), g)
    _same(a, g)


@pytest.mark.parametrize("s", TYPES)
@pytest.mark.parametrize("shape,nhwc,off", [((4, 24, 9, 9), False, 0), ((4, 24, 9, 9), True, 0),
                                            ((3, 5, 7, 3), False, 0), ((3, 5, 7, 3), True, 0),
                                            ((2, 13, 5, 5), True, 1), ((2, 12, 1, 1), False, 2),
                                            ((5, 19), False, 0)])
@pytest.mark.parametrize("bias,relu", [(True, False), (True, True), (False, True)])
def test_bias_act_matches_the_generic_kernel(s, shape, nhwc, off, bias, relu):
    n = int(np.prod(shape))
    y0 = _w(_words(n, 4), s)
    c = shape[1] if len(shape) > 1 else 1       # (N, C, ...), held channels-last with nhwc
    b = cp.asarray(_floats(c, 5)) if bias else None
    y = _dev(y0, off).reshape(shape)
    reduced.bias_act(y, s, bias=b, relu=relu, nhwc=nhwc)
    g = _dev(y0).reshape(shape)
    hw = 1 if nhwc else int(np.prod(shape[2:]))
    reduced.generic_kernel(s, "bias_act")(b if bias else cp.zeros(1, np.float32), c, hw,
                                          np.int32(int(bias) | (2 if relu else 0)), g)
    _same(y, g)


@pytest.mark.parametrize("s", TYPES)
@pytest.mark.parametrize("n,off", SIZES)
def test_casts_match_the_generic_kernels(s, n, off):
    x = _floats(n, 6)
    dt = _dtype(s)
    h = _dev(np.zeros(n, dt), off)
    kp.to_reduced(_dev(x, off), h, s)
    hg = _dev(np.zeros(n, dt))
    kp.generic_kernel(s, "to")(_dev(x), hg)
    _same(h, hg)
    if s == P.BFLOAT16:
        _same(h, _bf16_of(x))
    words = _w(_words(n, 7), s)
    y0 = _floats(n, 8)
    for acc in (False, True):
        for rounded in (False, True):
            y = _dev(y0, off)
            kp.from_reduced(_dev(words, off), y, s, accumulate=acc, rounded=rounded)
            yg = _dev(y0)
            mode = (4 if acc else 0) | (8 if rounded else 0)
            kp.generic_kernel(s, "from")(_dev(words), yg, 1, 1, np.int32(mode), yg)
            _same(y, yg)


@pytest.mark.parametrize("s", TYPES)
@pytest.mark.parametrize("shape,off", [((4, 24, 9, 9), 0), ((3, 5, 7, 3), 0), ((2, 13, 5, 5), 1),
                                       ((5, 19), 2)])
def test_from_reduced_bias_relu_rounded_matches_the_generic_kernel(s, shape, off):
    n = int(np.prod(shape))
    words = _w(_words(n, 9), s)
    b = cp.asarray(_floats(shape[1], 10))
    y0 = _floats(n, 11)
    for relu in (False, True):
        for rounded in (False, True):
            y = _dev(y0, off).reshape(shape)
            kp.from_reduced(_dev(words, off).reshape(shape), y, s, bias=b, relu=relu,
                            rounded=rounded)
            yg = _dev(y0).reshape(shape)
            hw = int(np.prod(shape[2:]))
            mode = 1 | (2 if relu else 0) | (8 if rounded else 0)
            kp.generic_kernel(s, "from")(_dev(words).reshape(shape), b, shape[1], hw,
                                         np.int32(mode), yg)
            _same(y, yg)


@pytest.mark.parametrize("s", TYPES)
@pytest.mark.parametrize("shape", [(64, 3, 49), (5, 37, 9), (3, 70, 33), (2, 1, 5),
                                   (70000, 2, 3)])
def test_transposed_casts(s, shape):
    x = _floats(int(np.prod(shape)), 12).reshape(shape)
    B, p, q = shape
    h = cp.empty((B, q, p), dtype=_dtype(s))
    kp.to_reduced_t(cp.asarray(x), h, s)
    ref = cp.empty((B, q, p), dtype=_dtype(s))
    kp.to_reduced(cp.asarray(x).transpose(0, 2, 1), ref, s)      # the generic kernel
    _same(h, ref)
    words = _w(_words(h.size, 13), s).reshape(B, q, p)
    y0 = _floats(x.size, 14).reshape(shape)
    for acc in (False, True):
        y = cp.asarray(y0)
        kp.from_reduced_t(cp.asarray(words), y, s, accumulate=acc)
        yg = cp.asarray(y0)
        kp.from_reduced(cp.asarray(words).transpose(0, 2, 1), yg, s, accumulate=acc)
        _same(y, yg)


def test_transposed_casts_want_contiguous_transposed_shapes():
    x = cp.zeros((2, 3, 4), dtype=np.float32)
    with pytest.raises(ValueError, match="to_reduced_t"):
        kp.to_reduced_t(x, cp.zeros((2, 3, 4), dtype=np.uint16), P.BFLOAT16)
    with pytest.raises(ValueError, match="from_reduced_t"):
        kp.from_reduced_t(cp.zeros((2, 3, 4), dtype=np.uint16), x[:, :, ::2], P.BFLOAT16)


# -- numpy models of bf16's rounding (the kernels' rule: nearest even, NaN made quiet) ----
def _bf16_of(a):
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    r = ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    r[nan] = ((u[nan] >> 16) | np.uint32(0x40)).astype(np.uint16)
    return r
