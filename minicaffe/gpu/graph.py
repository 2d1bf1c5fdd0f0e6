"""CUDA graph capture, in the manner of ``torch.cuda.graph``: a binding, no policy.

``private_pool()`` is a memory pool of a graph's own: PyTorch's rule, nothing else may reuse
the addresses a captured region allocated.  ``allocating_from(pool)`` makes CuPy allocate
from it (the eager warm-up run before a capture uses it too, so that what the capture
replaces is freed there).  ``capture(stream, pool, body)`` runs ``body()`` while ``stream``
captures, its temporaries from ``pool``, and returns the graph; ``graph.launch(stream)``
replays it.  What to capture, when, and what a replay means for the host's view of memory
is the engine's business (``engine/step.py``).
"""
import contextlib

from ..core import backend


def private_pool():
    return backend.cp.cuda.MemoryPool()


@contextlib.contextmanager
def allocating_from(pool):
    with backend.cp.cuda.using_allocator(pool.malloc):
        yield


def capture(stream, pool, body):
    """The CUDA graph of ``body()`` run on ``stream`` (which must be current in ``body``),
    allocating from ``pool``; an exception of ``body`` or of the capture propagates after
    the capture has ended."""
    with allocating_from(pool):
        stream.begin_capture()
        try:
            body()
        finally:
            graph = stream.end_capture()
    return graph
