import numpy as np
import pytest

from minicaffe.core import backend, context
from minicaffe.core.synced_memory import (SyncedMemory, UNINITIALIZED, HEAD_AT_CPU, HEAD_AT_GPU,
                                     SYNCED)


def test_cpu_first_touch_allocates_zeros():
    m = SyncedMemory(10)
    assert m.head == UNINITIALIZED
    d = m.cpu_data()
    assert m.head == HEAD_AT_CPU
    assert d.shape == (10,) and d.dtype == np.float32 and not d.any()


def test_mutable_cpu_keeps_head_at_cpu_and_same_buffer():
    m = SyncedMemory(4)
    a = m.mutable_cpu_data()
    a[:] = 3
    assert m.head == HEAD_AT_CPU
    assert m.cpu_data() is a
    assert m.head == HEAD_AT_CPU


def test_set_cpu_data_shares_and_does_not_own():
    m = SyncedMemory(6)
    buf = np.arange(6, dtype=np.float32)
    m.set_cpu_data(buf)
    assert m.head == HEAD_AT_CPU
    assert m.cpu_data() is buf
    assert not m.owns_cpu_data
    buf[0] = 42
    assert m.cpu_data()[0] == 42


def test_set_cpu_data_rejects_wrong_size_or_dtype():
    m = SyncedMemory(6)
    with pytest.raises(ValueError):
        m.set_cpu_data(np.zeros(3, np.float32))
    with pytest.raises(ValueError):
        m.set_cpu_data(np.zeros(6, np.float64))


def test_async_gpu_data_requires_head_at_cpu():
    m = SyncedMemory(4)
    with pytest.raises(RuntimeError, match="HEAD_AT_CPU"):
        m.async_gpu_data(None)


def test_release_gpu_refuses_to_lose_data():
    m = SyncedMemory(4)
    m.head = HEAD_AT_GPU
    with pytest.raises(RuntimeError):
        m.release_gpu()


@pytest.mark.gpu
class TestGPU:
    def setup_method(self):
        context.set_mode_gpu()

    def test_gpu_first_touch_allocates_zeros(self):
        m = SyncedMemory(10)
        g = m.gpu_data()
        assert m.head == HEAD_AT_GPU
        assert not bool(g.any())

    def test_cpu_to_gpu_copies_then_synced_noop(self):
        m = SyncedMemory(5)
        m.mutable_cpu_data()[:] = np.arange(5)
        g = m.gpu_data()
        assert m.head == SYNCED
        np.testing.assert_array_equal(backend.to_numpy(g), np.arange(5))
        # SYNCED: no copy either way; the buffers stay the same objects
        c = m.cpu_data()
        assert m.head == SYNCED and m.gpu_data() is g and m.cpu_data() is c

    def test_gpu_to_cpu_copies_only_when_newer(self):
        m = SyncedMemory(3)
        m.mutable_gpu_data()[...] = 7
        assert m.head == HEAD_AT_GPU
        c = m.cpu_data()
        assert m.head == SYNCED
        np.testing.assert_array_equal(c, [7, 7, 7])
        m.mutable_cpu_data()[0] = 1
        assert m.head == HEAD_AT_CPU
        assert float(m.gpu_data()[0]) == 1 and m.head == SYNCED

    def test_host_memory_is_pinned_in_gpu_mode(self):
        m = SyncedMemory(16)
        m.cpu_data()
        assert m.pinned

    def test_set_gpu_data_shares(self):
        cp = backend.cp
        m = SyncedMemory(4)
        buf = cp.arange(4, dtype=cp.float32)
        m.set_gpu_data(buf)
        assert m.head == HEAD_AT_GPU and m.gpu_data() is buf and not m.owns_gpu_data
        np.testing.assert_array_equal(m.cpu_data(), np.arange(4))

    def test_async_gpu_data_on_stream_ends_synced(self):
        m = SyncedMemory(1 << 16)
        m.mutable_cpu_data()[:] = 2
        s = backend.new_stream()
        g = m.async_gpu_data(s)
        s.synchronize()
        assert m.head == SYNCED
        assert float(g.sum()) == 2 * (1 << 16)

    def test_release_and_refill_gpu(self):
        m = SyncedMemory(8)
        m.mutable_gpu_data()[...] = 5
        m.cpu_data()
        m.release_gpu()
        assert m.head == HEAD_AT_CPU and m.device_array is None
        assert float(m.gpu_data().sum()) == 40


# -- the engine's transitions (a memory plan's arena, offload, graphs) ------------------------
def test_bind_unbind_park_with_numpy_standing_in_for_the_device(monkeypatch):
    """The transitions the memory plan and the offloader use, with numpy arrays standing in
    for device arrays (the copies are the host's; the states are the point)."""
    from minicaffe.core import backend
    monkeypatch.setattr(backend, "copy_to_gpu", lambda dst, src, stream=None:
                        dst.__setitem__(Ellipsis, src))
    monkeypatch.setattr(backend, "copy_to_host", lambda dst, src, stream=None:
                        dst.__setitem__(Ellipsis, src))
    monkeypatch.setattr(backend, "cp", np)
    m = SyncedMemory(4, np.float32)
    m.mutable_cpu_data()[...] = [1, 2, 3, 4]
    arena = np.zeros(8, np.float32)
    m.bind_device(arena[2:6])                       # the newest contents go with it
    assert m.head == HEAD_AT_GPU and m.planned and not m.owns_gpu_data
    np.testing.assert_array_equal(arena[2:6], [1, 2, 3, 4])
    arena[2:6] += 10                                # the step writes the arena
    m.unbind_device(keep=True)                      # kept: back to the host
    assert m.head == HEAD_AT_CPU and not m.planned and m.device_array is None
    np.testing.assert_array_equal(m.cpu_data(), [11, 12, 13, 14])
    d = SyncedMemory(4, np.float32)
    d.bind_device(arena[4:], keep_contents=False)
    d.unbind_device(keep=False)                     # transient (a diff): dropped
    assert d.head == UNINITIALIZED and d.device_array is None and not d.planned
    m.cpu_data()
    m.unbind_device(keep=False)                     # not bound: nothing happens
    assert m.head == HEAD_AT_CPU
    # offload: a host slot becomes the newest side, the device side goes
    slot = np.full(4, 7, np.float32)
    m.bind_device(arena[:4], keep_contents=False)
    m.park(slot)
    assert m.head == HEAD_AT_CPU and m.host_array is slot and m.device_array is None
    assert not m.planned and not m.owns_cpu_data
    m.drop_host()                                   # the slab is about to be freed
    assert m.host_array is None
    m.bind_device(arena[:4], keep_contents=False)
    m.device_written()
    assert m.head == HEAD_AT_GPU
