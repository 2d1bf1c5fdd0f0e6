"""The flat parameter buffer: blobs become slices of one SyncedMemory."""
import numpy as np
import pytest

from minicaffe import Net
from minicaffe.core import backend, context
from minicaffe.core.blob import Blob
from minicaffe.core.flat_params import ALIGN, FlatBuffer, FlatLayout
from minicaffe.core.synced_memory import HEAD_AT_CPU, HEAD_AT_GPU, SyncedMemorySlice

NET = """
name: "flat"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 dim: 5 dim: 5 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        convolution_param { num_output: 4 kernel_size: 3 weight_filler { type: "gaussian" std: 0.1 }
                            bias_filler { type: "constant" value: 0.5 } } }
layer { name: "ip" type: "InnerProduct" bottom: "conv" top: "ip"
        param { name: "shared_w" } inner_product_param { num_output: 3 weight_filler { type: "xavier" } } }
layer { name: "ip2" type: "InnerProduct" bottom: "ip" top: "ip2"
        inner_product_param { num_output: 3 weight_filler { type: "xavier" } } }
"""


def test_layout_aligns_every_blob():
    lay = FlatLayout([3, ALIGN, ALIGN + 1, 0, 7])
    assert lay.offsets == [0, ALIGN, 2 * ALIGN, 4 * ALIGN, 4 * ALIGN]
    assert lay.total == 5 * ALIGN
    t = lay.chunk_table(ALIGN // 4)
    assert t.shape == (lay.total // (ALIGN // 4),)
    # every chunk that starts inside blob i says i
    for i, (off, n) in enumerate(zip(lay.offsets, lay.counts)):
        for c in range(off // (ALIGN // 4), (off + n + ALIGN // 4 - 1) // (ALIGN // 4)):
            assert t[c] == i
    with pytest.raises(ValueError):
        lay.chunk_table(3)


def test_blobs_keep_values_and_become_slices():
    rng = np.random.RandomState(0)
    blobs = [Blob((2, 3)), Blob((5,)), Blob((4, 1, 2))]
    vals = [rng.randn(*b.shape).astype(np.float32) for b in blobs]
    diffs = [rng.randn(*b.shape).astype(np.float32) for b in blobs]
    for b, v, d in zip(blobs, vals, diffs):
        b.data[...] = v
        b.diff[...] = d
    fb = FlatBuffer(blobs)
    for b, v, d, off in zip(blobs, vals, diffs, fb.offsets):
        assert isinstance(b.data_mem, SyncedMemorySlice)
        np.testing.assert_array_equal(b.data, v)
        np.testing.assert_array_equal(b.diff, d)
        np.testing.assert_array_equal(fb.data.cpu_data()[off:off + b.count()], v.ravel())
    # writes through a blob land in the buffer, and the reverse
    blobs[1].data[2] = 42
    assert fb.data.cpu_data()[fb.offsets[1] + 2] == 42
    fb.diff.mutable_cpu_data()[:] = 0
    assert not blobs[2].diff.any()
    # the gaps hold zeros
    mask = np.ones(fb.total, bool)
    for off, n in zip(fb.offsets, fb.counts):
        mask[off:off + n] = False
    assert not fb.data.cpu_data()[mask].any()
    assert fb.intact()


def test_reshape_past_the_slice_detaches_and_is_detected():
    blobs = [Blob((4,)), Blob((3,))]
    fb = FlatBuffer(blobs)
    blobs[0].reshape((2,))
    assert fb.intact()  # smaller fits in place
    blobs[0].reshape((9,))
    assert not fb.intact()
    assert blobs[0].count() == 9 and blobs[0].data.shape == (9,)


def test_slice_refuses_to_adopt_an_array():
    fb = FlatBuffer([Blob((4,))])
    with pytest.raises(RuntimeError):
        fb.blobs[0].data_mem.set_cpu_data(np.zeros(4, np.float32))


def test_history_like_shares_the_layout():
    params = [Blob((3, 2)), Blob((7,))]
    fb = FlatBuffer(params)
    hist = [Blob(b.shape) for b in params]
    hb = fb.like(hist)
    assert hb.offsets == fb.offsets and hb.total == fb.total
    hist[1].data[...] = 1
    assert hb.data.cpu_data()[hb.offsets[1]:hb.offsets[1] + 7].sum() == 7
    with pytest.raises(ValueError):
        fb.like([Blob((2,))])


def test_net_flat_params_keeps_outputs_and_sharing():
    net = Net(NET, phase=1)
    before = {k: [b.data.copy() for b in v] for k, v in net.params.items()}
    x = np.random.RandomState(3).randn(2, 3, 5, 5).astype(np.float32)
    net.blobs["data"].data[...] = x
    ref = net.forward()["ip2"].copy()
    fb = net.flat_params()
    assert net.flat_params() is fb
    assert len(fb.blobs) == len(net.learnable_params)
    for k, v in net.params.items():
        for b, old in zip(v, before[k]):
            np.testing.assert_array_equal(b.data, old)
    net.blobs["data"].data[...] = x
    np.testing.assert_array_equal(net.forward()["ip2"], ref)
    # clear_param_diffs clears the whole buffer at once
    fb.diff.mutable_cpu_data()[:] = 3
    net.clear_param_diffs()
    assert not fb.diff.cpu_data().any()


def test_net_shared_param_follows_the_owner():
    shared = NET.replace('top: "ip2"\n        inner_product_param',
                         'top: "ip2"\n        param { name: "w2" } inner_product_param') + """
layer { name: "ip3" type: "InnerProduct" bottom: "ip2" top: "ip3"
        param { name: "w2" } inner_product_param { num_output: 3 } }
"""
    net = Net(shared, phase=1)
    assert len(net.learnable_params) == len(net.params_) - 1
    fb = net.flat_params()
    owner, user = net.layer_by_name("ip2").blobs[0], net.layer_by_name("ip3").blobs[0]
    assert user.data_mem is owner.data_mem and user.diff_mem is owner.diff_mem
    user.data[...] = 7
    i = net.learnable_params.index(owner)
    assert (fb.data.cpu_data()[fb.offsets[i]:fb.offsets[i] + owner.count()] == 7).all()


@pytest.mark.gpu
def test_slices_follow_the_parent_head_on_gpu():
    context.set_mode_gpu()
    blobs = [Blob((3,)), Blob((5,))]
    blobs[0].data[...] = [1, 2, 3]
    fb = FlatBuffer(blobs)
    g = blobs[0].mutable_gpu_data()
    assert fb.data.head == HEAD_AT_GPU and blobs[1].data_mem.head == HEAD_AT_GPU
    g *= 2
    np.testing.assert_array_equal(blobs[0].data, [2, 4, 6])
    assert fb.data.head == HEAD_AT_CPU
    assert backend.is_gpu_array(blobs[1].gpu_data())
