"""Winograd's minimal filtering F(4x4, 5x5) for the numpy convolution engine
(kernels/conv.py): a 5x5, stride-1 convolution computed on 8x8 input tiles that give
4x4 output tiles, with 64 products per tile and channel pair instead of 400 (6.25x fewer
multiplications in the products), at the cost of three small transforms:

    y_tile = A^T [ (G w G^T) (.) (B^T d_tile B) ] A     (Lavin & Gray, 2015)

over the interpolation points 0, 1, -1, 2, -2, 1/2, -1/2 and infinity.  The transforms
run separably (two GEMMs with an 8x8 or 4x8 matrix each), the 64 tile points' products
as one stacked matmul.  docs/vision.md ("Winograd F(4x4, 5x5) on the CPU") gives the
measured error against the direct method; docs/performance.md the speed.

Only the matrices and the per-tile transforms live here; the chunking, padding and
threads are the engine's.
"""
from fractions import Fraction

import numpy as np

M, R = 4, 5              # output tile, kernel
ALPHA = M + R - 1        # input tile: 8
POINTS = (0, 1, -1, 2, -2, Fraction(1, 2), Fraction(-1, 2))   # and infinity

# B^T for these points and the G below (solved once from the identity; the tests check it)
_BT = np.array([
    [-1, 0, 21 / 4, 0, -21 / 4, 0, 1, 0],
    [0, 1, 1, -17 / 4, -17 / 4, 1, 1, 0],
    [0, -1, 1, 17 / 4, -17 / 4, -1, 1, 0],
    [0, 1 / 2, 1 / 4, -5 / 2, -5 / 4, 2, 1, 0],
    [0, -1 / 2, 1 / 4, 5 / 2, -5 / 4, -2, 1, 0],
    [0, 2, 4, -5 / 2, -5, 1 / 2, 1, 0],
    [0, -2, 4, 5 / 2, -5, -1 / 2, 1, 0],
    [0, -1, 0, 21 / 4, 0, -21 / 4, 0, 1]])


def _matrices():
    """(A^T (4, 8), G (8, 5), B^T (8, 8)) in float64: A^T's columns are the points'
    powers, G's rows the kernel's powers over prod_l (p_j - p_l); the point at infinity
    takes the last output and the last kernel tap."""
    at = np.zeros((M, ALPHA))
    g = np.zeros((ALPHA, R))
    for j, p in enumerate(POINTS):
        f = Fraction(1)
        for q in POINTS:
            if q != p:
                f *= p - q
        for i in range(M):
            at[i, j] = float(Fraction(p) ** i)
        for k in range(R):
            g[j, k] = float(Fraction(p) ** k / f)
    at[M - 1, ALPHA - 1] = 1.0
    g[ALPHA - 1, R - 1] = 1.0
    return at, g, _BT.copy()


AT64, G64, BT64 = _matrices()
AT = AT64.astype(np.float32)
BT = BT64.astype(np.float32)
A = np.ascontiguousarray(AT.T)          # (8, 4): the output transform's transpose
B = np.ascontiguousarray(BT.T)          # (8, 8): the input transform's
# the tile point (1, 1): A^T's column for the point 1 is all ones, so a value added to
# every channel's M there is added to all 16 outputs of the tile (the bias)
ONES = 1 * ALPHA + 1
GG64 = np.kron(G64, G64)                # (64, 25): w (5x5) -> U (8x8)
GG32 = GG64.astype(np.float32)


def _gg(dtype):
    return GG32 if dtype == np.float32 else GG64.astype(dtype, copy=False)


def weights(w):
    """U (64, C, O) from w (O, C, 5, 5): G w G^T per channel pair, one GEMM in w's dtype
    (a float32 product of 25 terms: far within the method's own error)."""
    O, C = w.shape[:2]
    u = _gg(w.dtype) @ w.transpose(1, 0, 2, 3).reshape(C * O, R * R).T
    return u.reshape(ALPHA * ALPHA, C, O)


def weight_grad(du):
    """dw (O, C, 5, 5) from dU (64, C, O): G^T dU G per channel pair, one GEMM."""
    _, C, O = du.shape
    dw = du.reshape(ALPHA * ALPHA, C * O).T @ _gg(du.dtype)     # (C*O, 25)
    return dw.reshape(C, O, R, R).transpose(1, 0, 2, 3)


def input_tiles(x8, z, v):
    """V = B^T d B for tiles ``x8`` (8, 8, L) (tile rows, tile columns, tiles x
    channels): ``v`` (64, L) written, ``z`` (8, 8, L) scratch."""
    bt = BT if x8.dtype == np.float32 else BT64
    L = x8.shape[2]
    np.matmul(bt, x8.reshape(ALPHA, ALPHA * L), out=z.reshape(ALPHA, ALPHA * L))
    np.matmul(bt, z, out=v.reshape(ALPHA, ALPHA, L))
    return v


def input_tiles_adjoint(v, z, d):
    """B dV B^T for ``v`` (8, 8, L) (tile points, tiles x channels): the data gradient of
    ``input_tiles``'s tiles, ``d`` (8, 8, L) written, ``z`` (8, 8, L) scratch."""
    b = B if v.dtype == np.float32 else np.ascontiguousarray(BT64.T)
    L = v.shape[2]
    np.matmul(b, v.reshape(ALPHA, ALPHA * L), out=z.reshape(ALPHA, ALPHA * L))
    np.matmul(b, z, out=d)
    return d


def output_tiles(m, z, y):
    """Y = A^T M A for ``m`` (64, L) (tile points, tiles x channels): ``y`` (4, 4, L)
    written, ``z`` (4, 8, L) scratch."""
    at = AT if m.dtype == np.float32 else AT64
    L = y.shape[2]
    np.matmul(at, m.reshape(ALPHA, ALPHA * L), out=z.reshape(M, ALPHA * L))
    np.matmul(at, z, out=y)
    return y


def grad_tiles(dy4, z, out):
    """A dy A^T for output-gradient tiles ``dy4`` (4, 4, L): ``out`` (64, L) written
    (the transpose of ``output_tiles``), ``z`` (8, 4, L) scratch."""
    a = A if dy4.dtype == np.float32 else np.ascontiguousarray(AT64.T)
    L = dy4.shape[2]
    np.matmul(a, dy4.reshape(M, M * L), out=z.reshape(ALPHA, M * L))
    np.matmul(a, z, out=out.reshape(ALPHA, ALPHA, L))
    return out
