"""The GPU allocator, under the names the rest of minicaffe and its users call: CuPy's
default pool or the stream-ordered pool (cudaMallocAsync), and peak-memory readings.

The code lives in ``backend.py`` (the core installs the allocator when a thread first
switches to GPU mode, and the core imports nothing of gpu/); see its comments there.
``use("async"|"default")``, ``ensure()``, ``name()``, ``describe()``, ``reset_peak()``,
``peak_bytes()``, ``used_bytes()``.
"""
from ..core.backend import (DEFAULT_ALLOCATOR as DEFAULT, allocator_name as name,  # noqa: F401
                       describe_allocator as describe, ensure_allocator as ensure,
                       peak_gpu_bytes as peak_bytes, reset_peak_gpu_bytes as reset_peak,
                       use_allocator as use, used_gpu_bytes as used_bytes)
