"""``minicaffe bench`` on the GPU: the allocator's peak, CuPy synchronisation, the
PyTorch twin on CUDA against minicaffe's GPU step, and the whole step captured as one
CUDA graph (run on a GPU machine; skipped elsewhere)."""
import json
import os

import numpy as np
import pytest

from minicaffe.core import backend, context
from minicaffe import bench, synthetic

from bench_nets import SMALL_NETS

pytestmark = pytest.mark.gpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LENET = os.path.join(ROOT, "models", "lenet", "train_val.prototxt")
QUICK = ["--iterations", "3", "--repeats", "2", "--warmup", "2"]


def _cuda_torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch has no CUDA here")
    return torch


@pytest.fixture
def gpu_mode():
    context.set_device(0)
    context.set_mode_gpu()
    yield
    context.set_mode_cpu()


def test_peak_gpu_bytes_is_the_pools_high_water_mark(gpu_mode):
    cp = backend.cp
    backend.reset_peak_gpu_bytes()
    base = backend.peak_gpu_bytes()
    a = cp.ones(64 * 2 ** 20 // 4, dtype=cp.float32)  # 64 MiB
    assert backend.peak_gpu_bytes() - base >= 64 * 2 ** 20
    del a
    assert backend.peak_gpu_bytes() - base >= 64 * 2 ** 20  # freed: the mark stays
    backend.reset_peak_gpu_bytes()
    assert backend.peak_gpu_bytes() < base + 64 * 2 ** 20  # the cached block went back


def test_bench_on_the_gpu_with_torch_eager_and_graph(cli, tmp_path):
    torch = _cuda_torch()
    rc, out, err = cli("bench", "--gpu", "0", "--model", LENET, "--batch", "16",
                       "--compare", "torch", "--json", "r.json", *QUICK)
    assert rc == 0, err
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["machine"]["device"] == "gpu:0" and r["machine"]["gpu"]
    assert r["timing"]["synchronised"] is True
    assert r["tf32"]["torch"] is False
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    net = r["nets"][0]
    assert [e["engine"] for e in net["results"]] == ["minicaffe", "torch eager", "torch graph"]
    assert set(net["ratios"]) == {"minicaffe/torch_eager", "minicaffe/torch_graph"}
    for e in net["results"]:
        assert e["peak_bytes"] > 0 and e["ms_per_iter"] > 0
    assert net["results"][0]["peak_what"].startswith("minicaffe GPU allocator")
    head = next(l for l in out.splitlines() if l.startswith("net "))
    assert "torch graph ms" in head and "mc/graph" in head and "graph peak MiB" in head
    assert f"GPU: {r['machine']['gpu']} (gpu:0)" in out


def test_bench_gpu_tf32_switch(cli, tmp_path):
    torch = _cuda_torch()
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        rc, out, err = cli("bench", "--gpu", "0", "--model", LENET, "--batch", "8",
                           "--compare", "torch", "--tf32", *QUICK)
        assert rc == 0, err
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        assert "torch on" in out
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def test_bench_gpu_test_phase_captures_the_forward(cli, tmp_path):
    _cuda_torch()
    rc, out, err = cli("bench", "--gpu", "0", "--model", LENET, "--phase", "TEST",
                       "--batch", "16", "--compare", "torch", "--json", "r.json", *QUICK)
    assert rc == 0, err
    results = json.loads((tmp_path / "r.json").read_text())["nets"][0]["results"]
    assert [e["engine"] for e in results] == ["minicaffe", "torch eager", "torch graph"]


def test_synthetic_inputs_stay_on_the_gpu(gpu_mode):
    """Filled once: after the first step the inputs live on the GPU, and the timed steps
    copy nothing from the host."""
    solver, _ = synthetic.synthetic_solver(model=LENET, batch=8)
    solver.step(1)
    data = solver.net.blobs["data"]
    before = backend.cp.asnumpy(data.gpu_data()).copy()
    ptr = data.gpu_data().data.ptr
    solver.step(2)
    assert data.gpu_data().data.ptr == ptr
    np.testing.assert_array_equal(backend.cp.asnumpy(data.gpu_data()), before)


@pytest.mark.parametrize("name", ["lenet", "alexnet_small", "resnet_small", "googlenet_small"])
def test_twin_on_cuda_trains_like_minicaffe_on_the_gpu(name, tmp_path, gpu_mode):
    torch = _cuda_torch()
    from test_torch_twin import _solver, compare_steps
    bench.set_torch_precision(torch, tf32=False, gpu=0)
    if name == "lenet":
        solver = _solver(tmp_path, model=LENET, batch=8)
    else:
        solver = _solver(tmp_path, SMALL_NETS[name])
    compare_steps(solver, steps=2, rtol=1e-3, device="cuda:0")


def test_cuda_graph_replay_trains_like_eager(tmp_path):
    """The captured step (warm-up steps, then replays) gives the weights of the same
    number of eager steps."""
    torch = _cuda_torch()
    from minicaffe.torch_twin import TorchTwin, make_optimizer
    bench.set_torch_precision(torch, tf32=False, gpu=0)
    solver, _ = synthetic.synthetic_solver(model=LENET, batch=16)  # built on the CPU
    net = solver.net
    twins = [TorchTwin(net, "cuda:0") for _ in range(2)]
    eager, graphed = twins
    inputs = [t.inputs_from(net) for t in twins]
    opt = make_optimizer(eager, solver.param)
    warmup, replays = 3, 4
    for _ in range(warmup + replays):
        eager.train_step(inputs[0], opt)
    replay = bench.capture_cuda_graph(graphed, inputs[1], solver.param, warmup)
    for _ in range(replays):
        replay()
    torch.cuda.synchronize()
    for a, b in zip(eager.weights, graphed.weights):
        np.testing.assert_allclose(b.detach().cpu().numpy(), a.detach().cpu().numpy(),
                                   rtol=1e-4, atol=1e-6)
    initial = TorchTwin(net).weights  # on the CPU: the steps did change the weights
    assert any(not torch.equal(a.detach().cpu(), c) for a, c in zip(eager.weights, initial))
