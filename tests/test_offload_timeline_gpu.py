"""The offload timeline on a GPU (offload.trace_iteration, what benchmarks/offload.py
prints): one eager forward-backward with CUDA events, every step and copy recorded, the
weights untouched.  Marked gpu: skips without CuPy and a device."""
import numpy as np
import pytest

from minicaffe.engine import offload

from test_offload_gpu import _solver, _weights, gpu  # noqa: F401 (gpu: a fixture)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("policy", ["NONE", "ALL"])
def test_trace_iteration_records_compute_and_copies(gpu, policy):  # noqa: F811
    s = _solver(policy)
    s.step(3)
    before = _weights(s)
    tl = offload.trace_iteration(s.gpu_step)
    for a, b in zip(before, _weights(s)):
        np.testing.assert_array_equal(a, b)
    rows = tl.rows()
    net = s.net
    L, first = len(net.layers), offload.n_prologue(net)
    steps = [r["step"] for r in rows]
    assert steps == sorted(steps) and set(range(first, 2 * L - first)) <= set(steps)
    assert all(r["ms"] >= 0 and r["wait"] >= 0 for r in rows)
    assert all(a["start"] <= b["start"] for a, b in zip(rows, rows[1:]))
    sm = tl.summary()
    off = s.gpu_step.offload
    if policy == "NONE":
        assert off is None and not tl.copy_times and sm["out_bytes"] == 0
    else:
        assert sm["out_bytes"] == off.oplan.moved_bytes > 0
        assert sm["in_bytes"] == off.oplan.returned_bytes
        assert all(b > a for *_, a, b in tl.copy_times) and sm["model"] > 0
    assert sm["span"] >= sm["compute"] > 0
    s.step(2)                      # the replayed step goes on after the eager trace
    assert s.iter == 5
