"""Which cuts of a float32 product keep its bits on this machine's BLAS (kernels/blas.py's
SPLITS): for 8 shapes (InnerProduct's and odd ones), every cut of the rows (or columns) at
multiples of ALIGN, the parts' results against the whole product's, bit for bit.  One BLAS
thread.  Prints, per axis and alignment, "ok" when every cut gave the whole product's bits.

    python benchmarks/gemm_split_bits.py
    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/gemm_split_bits.py
"""
import numpy as np
import threadpoolctl

SHAPES = [(64, 800, 500), (33, 1000, 1500), (128, 128, 128), (256, 512, 64),
          (100, 75, 1024), (500, 800, 100), (200, 3200, 64), (96, 96, 2000)]
ALIGNS = (8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384)


def main():
    threadpoolctl.threadpool_limits(1)
    print("BLAS:", [(i["internal_api"], i.get("version"), i.get("architecture"))
                    for i in threadpoolctl.threadpool_info()])
    rs = np.random.RandomState(1)
    for axis, name in ((0, "rows"), (1, "columns")):
        for align in ALIGNS:
            ok, tried = True, 0
            for M, K, N in SHAPES:
                a = rs.randn(M, K).astype(np.float32)
                b = rs.randn(N, K).astype(np.float32)
                whole = a @ b.T
                for s in range(align, M if axis == 0 else N, align):
                    tried += 1
                    if axis == 0:
                        parts = np.concatenate([a[:s] @ b.T, a[s:] @ b.T], axis=0)
                    else:
                        parts = np.concatenate([a @ b[:s].T, a @ b[s:].T], axis=1)
                    ok &= np.array_equal(whole, parts)
            print(f"{name:7s} cut at multiples of {align:3d}: {'ok' if ok else 'bits differ'}"
                  f" ({tried} cuts)")


if __name__ == "__main__":
    main()
