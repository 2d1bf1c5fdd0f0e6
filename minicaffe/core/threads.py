"""CPU threads: how many threads numpy's BLAS (which runs minicaffe's CPU GEMMs) may use, and
minicaffe's own kernel pool (batch-parallel numpy convolutions and poolings).

No Caffe counterpart (Caffe leaves it to OpenBLAS/MKL and their environment variables).

The default is **one BLAS thread per process**, unless the user asked for something else:
one of ``OPENBLAS_NUM_THREADS``, ``OMP_NUM_THREADS``, ``MKL_NUM_THREADS``,
``BLIS_NUM_THREADS`` set in the environment (then minicaffe leaves the BLAS as it is), the
``--threads N`` flag of ``minicaffe train/test/time/bench``, or ``minicaffe.set_num_threads(n)``
in Python.  Why one: minicaffe's CPU step is a chain of small GEMMs and numpy element-wise
work; a second BLAS thread bought 0-10% on a quiet 2-core machine (CIFAR-10 quick 139 -> 124
ms per step), and under outside load the spinning BLAS threads burned 4.7x the CPU for the
same work and ran the LeNet example 3x slower (docs/cli.md, "CPU threads").

With more than one thread (``--threads N``, ``set_num_threads(n)``, n > 1) minicaffe runs
its own **kernel pool** of n threads instead: the numpy convolutions' batch chunks
(kernels/conv.py), the larger poolings' batch ranges (kernels/pooling.py), the larger GEMMs'
row or column blocks (kernels/blas.py: InnerProduct) and element-wise flat ranges
(``split_flat``: ReLU) run in it, with results bit-identical to one thread (the
weight-gradient partials are summed in the serial order), and numpy's BLAS stays on one
thread (its idle threads spin and take the cores from
the pool; docs/performance.md, "The kernel pool").  PyTorch parallelises its CPU step
over the batch too.  The ``*_NUM_THREADS`` variables alone set the BLAS only (no pool).

The count is set at run time through threadpoolctl (a core dependency: a small pure-Python
package, 3.5 or later: older ones do not see numpy 2's OpenBLAS), which works whether or not
numpy was imported first.  Without threadpoolctl (or with an older one) the default still
holds when minicaffe is imported before numpy (the environment variable is set then), and
``set_num_threads`` says in one line that it needs threadpoolctl >= 3.5.
"""
import os
import sys
import threading

DEFAULT_THREADS = 1
ENV_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS")

_limits = []        # threadpoolctl limiters applied so far, newest last
_OURS = {}          # environment variables minicaffe set itself (the fallback), and values


def asked_by_environment():
    """The environment variable the user set to choose the BLAS threads, else None."""
    for var in ENV_VARS:
        value = os.environ.get(var, "").strip()
        if value and _OURS.get(var) != value:
            return var
    return None


# threadpoolctl finds numpy 2's OpenBLAS (scipy-openblas, its symbols renamed) from 3.5 on;
# an older one sees no BLAS and sets nothing, silently, so that each kernel-pool thread
# would run a BLAS with all its threads.  minicaffe takes an older one for none at all.
THREADPOOLCTL_MIN = (3, 5)


def _version(text):
    parts = []
    for p in str(text).split(".")[:2]:
        digits = "".join(c for c in p if c.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def _threadpoolctl():
    try:
        import threadpoolctl
    except ImportError:
        return None
    if _version(getattr(threadpoolctl, "__version__", "0")) < THREADPOOLCTL_MIN:
        return None
    return threadpoolctl


_kernel = []        # the OpenBLAS kernel's name, once asked


def blas_kernel():
    """numpy's BLAS kernel as threadpoolctl names it, lower case ("haswell", "skylakex",
    what OPENBLAS_CORETYPE forces...), "" when it is not OpenBLAS or cannot be told
    (kernels/blas.py splits a product only where the kernel keeps its bits)."""
    if not _kernel:
        name = ""
        tpc = _threadpoolctl()
        try:
            for info in tpc.threadpool_info() if tpc is not None else ():
                if info.get("internal_api") == "openblas":
                    name = str(info.get("architecture") or "").lower()
                    break
        except Exception:       # threadpoolctl could not read a library: no split
            name = ""
        _kernel.append(name)
    return _kernel[0]


def _needs_threadpoolctl(what):
    """The one-line error of ``what`` without a usable threadpoolctl (none, or too old)."""
    from .errors import MinicaffeError
    try:
        import threadpoolctl
        have = f" (this one is {threadpoolctl.__version__}, which cannot see numpy 2's OpenBLAS)"
    except ImportError:
        have = ""
    need = ".".join(map(str, THREADPOOLCTL_MIN))
    return MinicaffeError(f"{what} needs threadpoolctl >= {need}{have}: pip install -U "
                          f"threadpoolctl; or set OPENBLAS_NUM_THREADS before starting Python")


def apply_default():
    """At ``import minicaffe``: one BLAS thread unless the environment chose a count."""
    if asked_by_environment():
        return
    tpc = _threadpoolctl()
    if tpc is not None:
        import numpy  # noqa: F401  (its BLAS must be loaded to be found)
        _limits.append(tpc.threadpool_limits(limits=DEFAULT_THREADS, user_api="blas"))
    elif "numpy" not in sys.modules:
        # no threadpoolctl: before numpy loads OpenBLAS, its variable does the same
        os.environ["OPENBLAS_NUM_THREADS"] = _OURS["OPENBLAS_NUM_THREADS"] = \
            str(DEFAULT_THREADS)


def check_threads(n, what="--threads"):
    """``n`` as a positive int, or a MinicaffeError naming ``what``."""
    from .errors import MinicaffeError
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise MinicaffeError(f"{what} must be a whole number of threads, at least 1 "
                             f"(got {n!r})")
    limit = os.cpu_count() or 1
    if n > 4 * limit:
        raise MinicaffeError(f"{what} {n} is more than 4x this machine's {limit} CPU(s)")
    return n


def set_num_threads(n):
    """Use ``n`` CPU threads from now on (as ``torch.set_num_threads``).  With ``n > 1`` the
    numpy convolutions run their batch chunks in a pool of ``n`` threads (bit-identical to
    one thread) and numpy's BLAS stays on one thread: its own idle threads spin and take
    the cores from the pool (docs/performance.md, "The kernel pool").
    ``get_num_threads`` then reports ``n``."""
    n = check_threads(n, "set_num_threads")
    tpc = _threadpoolctl()
    if tpc is None:
        raise _needs_threadpoolctl("setting the CPU threads")
    import numpy  # noqa: F401  (its BLAS must be loaded to be found)
    _limits.append(tpc.threadpool_limits(limits=blas_threads(n), user_api="blas"))
    set_kernel_threads(n)


def one_thread():
    """In a CPU replica's worker process (engine/replicas.py): numpy's BLAS on one thread,
    whatever the environment says, and no kernel pool (the replicas are the parallelism)."""
    set_kernel_threads(1)
    tpc = _threadpoolctl()
    if tpc is not None:
        import numpy  # noqa: F401  (its BLAS must be loaded to be found)
        _limits.append(tpc.threadpool_limits(limits=1, user_api="blas"))


def blas_threads(n):
    """The BLAS threads of a run of ``n`` CPU threads: ``n`` without the kernel pool, one
    beside it (the pool's threads are the parallelism)."""
    return 1 if n > 1 else n


# -- the kernel pool: batch chunks of the numpy convolutions in parallel ------------------------
_pool = {"threads": 1, "executor": None, "blas": None}
_POOL_PREFIX = "minicaffe-cpu"


def set_kernel_threads(n):
    """``n`` threads for minicaffe's own batch-parallel CPU kernels (1: none, the default).
    Needs threadpoolctl (the pool's threads run their GEMMs on one BLAS thread each)."""
    n = int(n)
    if n == _pool["threads"]:
        return
    if _pool["executor"] is not None:
        _pool["executor"].shutdown(wait=True)
        _pool["executor"] = None
    _pool["threads"] = n
    if n > 1 and _threadpoolctl() is not None:
        from concurrent.futures import ThreadPoolExecutor
        _pool["executor"] = ThreadPoolExecutor(n, thread_name_prefix=_POOL_PREFIX)


def kernel_threads():
    return _pool["threads"] if _pool["executor"] is not None else 1


def kernel_pool():
    """The thread pool of the batch-parallel kernels, or None (one thread)."""
    return _pool["executor"]


_local = threading.local()   # .busy: this thread is running a part of ``run_parts``


def in_kernel_pool():
    """Whether the calling thread is running a part of the kernel pool's work (one of the
    pool's threads, or the caller of ``run_parts`` inside its own share): work it
    submitted to the pool could wait on itself, so it runs in place instead."""
    return (getattr(_local, "busy", False)
            or threading.current_thread().name.startswith(_POOL_PREFIX))


def run_parts(count, fn):
    """``[fn(slot, i) for i in range(count)]`` with the parts shared out in the kernel
    pool: the calling thread and up to ``kernel_threads() - 1`` of the pool's threads
    each take the next part not yet taken until none is left (a thread that the machine
    slows down takes fewer parts, instead of holding the others up at the end), and
    ``slot`` (0 .. threads-1) names the thread's own workspace.  The results come back
    in part order, so what the caller sums over them is summed in the serial order:
    which thread ran a part never changes the bits.  Without a pool, or inside one of
    its parts, the parts run in order in the calling thread (slot 0)."""
    pool = kernel_pool()
    t = min(kernel_threads(), count)
    if pool is None or t < 2 or in_kernel_pool():
        return [fn(0, i) for i in range(count)]
    results = [None] * count
    parts = iter(range(count))   # next() on it is atomic under the GIL: each part once

    def worker(slot):
        _local.busy = True
        try:
            for i in parts:
                results[i] = fn(slot, i)
        finally:
            _local.busy = False
    futures = [pool.submit(worker, slot) for slot in range(1, t)]
    error = None
    try:
        worker(0)
    except BaseException as e:   # noqa: B902  (the others are waited for first)
        error = e
    for f in futures:
        try:
            f.result()
        except BaseException as e:   # noqa: B902
            error = error or e
    if error is not None:
        raise error
    return results


# Element-wise work split over the pool in flat ranges of at least this many elements
# (about 100 us of numpy work).  2^16 (20-40 us a part) made CIFAR-10 quick's ReLUs slower
# on the GPU machine's 16 threads than on one (relu1 forward 0.51 -> 0.80 ms in 12 parts:
# each further part cost tens of us there); now they split in at most 3 parts, and on two
# threads relu1 and relu2 (819,200 elements) still in two.
ELEMENTWISE_MIN_PART = 1 << 18


def split_flat(count, fn, min_part=None):
    """With a kernel pool (and not inside one of its threads) and at least two parts of
    ``min_part`` elements (default ELEMENTWISE_MIN_PART): ``fn(a, b)`` for contiguous
    ranges [a, b) covering ``range(count)``, in the pool's threads; True when it ran so,
    else False (the caller runs its serial body).  Element-wise work gives the serial
    bits."""
    pool = kernel_pool()
    if pool is None or in_kernel_pool():
        return False
    t = min(kernel_threads(), count // max(min_part or ELEMENTWISE_MIN_PART, 1))
    if t < 2:
        return False
    cuts = [count * i // t for i in range(t + 1)]
    run_parts(t, lambda slot, i: fn(cuts[i], cuts[i + 1]))
    return True


class single_blas:
    """``with single_blas():`` the BLAS on one thread inside (the pool's threads share the
    cores already), its count before after."""

    def __enter__(self):
        if _pool["blas"] is None:
            import numpy  # noqa: F401
            _pool["blas"] = _threadpoolctl().ThreadpoolController().select(user_api="blas")
        self.saved = [(lib, lib.num_threads) for lib in _pool["blas"].lib_controllers]
        for lib, count in self.saved:
            if count != 1:
                lib.set_num_threads(1)
        return self

    def __exit__(self, *exc):
        for lib, count in self.saved:
            if count != 1:
                lib.set_num_threads(count)
        return False


def get_num_threads():
    """The CPU threads of minicaffe's step: the kernel pool's when there is one
    (``set_num_threads(n)``, n > 1), else the BLAS's (``blas_num_threads``)."""
    if kernel_threads() > 1:
        return kernel_threads()
    return blas_num_threads()


def blas_num_threads():
    """The threads numpy's BLAS uses now (threadpoolctl's report), or None when it cannot
    be read (no threadpoolctl: then the environment variable's value, if any)."""
    tpc = _threadpoolctl()
    if tpc is None:
        var = asked_by_environment() or ("OPENBLAS_NUM_THREADS"
                                         if "OPENBLAS_NUM_THREADS" in os.environ else None)
        try:
            return int(os.environ[var]) if var else None
        except ValueError:
            return None
    import numpy  # noqa: F401
    counts = [p["num_threads"] for p in tpc.threadpool_info() if p["user_api"] == "blas"]
    return max(counts) if counts else None


def describe():
    """One line for the log: the BLAS, its thread count and who chose it (and the kernel
    pool's threads, if any)."""
    n = blas_num_threads()
    var = asked_by_environment()
    tpc = _threadpoolctl()
    lib = ""
    if tpc is not None:
        libs = [p for p in tpc.threadpool_info() if p["user_api"] == "blas"]
        if libs:
            lib = f" ({libs[0]['internal_api']} {libs[0].get('version') or ''})".replace(" )",
                                                                                       ")")
    pool = (f"; convolutions batch-parallel on {kernel_threads()} threads"
            if kernel_threads() > 1 else "")
    return f"{n if n is not None else 'unknown'}{lib}{pool}", var


class limit:
    """``with limit(n):`` n BLAS threads inside the block, the previous count after it
    (the CLI holds ``--threads`` for one command this way)."""

    def __init__(self, n):
        self.n = n
        self._ctl = None

    def __enter__(self):
        tpc = _threadpoolctl()
        if self.n is None:
            return self
        if tpc is None:
            raise _needs_threadpoolctl("--threads")
        import numpy  # noqa: F401
        self._ctl = tpc.threadpool_limits(limits=blas_threads(self.n), user_api="blas")
        self._kernel = _pool["threads"]
        set_kernel_threads(self.n)
        return self

    def __exit__(self, *exc):
        if self._ctl is not None:
            self._ctl.restore_original_limits()
            set_kernel_threads(self._kernel)
        return False
