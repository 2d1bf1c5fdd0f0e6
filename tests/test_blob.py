import numpy as np
import pytest

from minicaffe.core.blob import Blob
from minicaffe.proto import caffe_pb2


def test_shape_count_and_legacy_accessors():
    b = Blob((2, 3, 4, 5))
    assert b.shape == (2, 3, 4, 5) and b.num_axes == 4
    assert b.count() == 120 and b.count(1) == 60 and b.count(1, 3) == 12
    assert (b.num, b.channels, b.height, b.width) == (2, 3, 4, 5)
    assert b.canonical_axis_index(-1) == 3
    with pytest.raises(IndexError):
        b.canonical_axis_index(4)
    v = Blob((7, 2))
    assert (v.num, v.channels, v.height, v.width) == (7, 2, 1, 1)
    assert Blob((2, 3, 4, 5)).offset(1, 2, 3, 4) == 119


def test_reshape_keeps_capacity_and_buffer():
    b = Blob((4, 5))
    mem = b.data_mem
    b.data[...] = 1
    b.reshape((2, 5))
    assert b.data_mem is mem and b.capacity == 20 and b.count() == 10
    b.reshape((5, 4))
    assert b.data_mem is mem
    b.reshape((5, 5))
    assert b.data_mem is not mem and b.capacity == 25


def test_negative_dimension_rejected():
    with pytest.raises(ValueError):
        Blob((2, -1))


def test_update_asum_sumsq_scale():
    b = Blob((3,))
    b.data[...] = [1, -2, 3]
    b.diff[...] = [0.5, 0.5, -1]
    assert b.asum_data() == 6 and b.sumsq_data() == 14
    assert b.asum_diff() == 2 and b.sumsq_diff() == 1.5
    b.update()
    np.testing.assert_allclose(b.data, [0.5, -2.5, 4])
    b.scale_data(2)
    b.scale_diff(-1)
    np.testing.assert_allclose(b.data, [1, -5, 8])
    np.testing.assert_allclose(b.diff, [-0.5, -0.5, 1])


def test_share_data_and_diff():
    a, b = Blob((2, 2)), Blob((4,))
    b.share_data(a)
    a.data[...] = 3
    assert (b.data == 3).all()
    b.share_diff(a)
    b.diff[...] = 2
    assert (a.diff == 2).all()
    with pytest.raises(ValueError):
        Blob((3,)).share_data(a)


def test_copy_from():
    a, b = Blob((2, 3)), Blob((2, 3))
    a.data[...] = np.arange(6).reshape(2, 3)
    a.diff[...] = 5
    b.copy_from(a)
    np.testing.assert_array_equal(b.data, a.data)
    b.copy_from(a, copy_diff=True)
    assert (b.diff == 5).all()
    c = Blob((6,))
    with pytest.raises(ValueError):
        c.copy_from(a)
    c.copy_from(a, reshape=True)
    assert c.shape == (2, 3)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_proto_round_trip(dtype):
    a = Blob((2, 3, 4), dtype)
    a.data[...] = np.random.RandomState(0).randn(2, 3, 4)
    a.diff[...] = np.random.RandomState(1).randn(2, 3, 4)
    p = a.to_proto(write_diff=True)
    assert tuple(p.shape.dim) == (2, 3, 4)
    assert (len(p.double_data) > 0) == (dtype == np.float64)
    # survives serialization
    p2 = caffe_pb2.BlobProto.FromString(p.SerializeToString())
    b = Blob(dtype=dtype)
    b.from_proto(p2)
    np.testing.assert_array_equal(b.data, a.data)
    np.testing.assert_array_equal(b.diff, a.diff)
    assert b.shape_equals(p2)


def test_from_legacy_4d_proto():
    p = caffe_pb2.BlobProto(num=1, channels=2, height=1, width=3)
    p.data.extend(range(6))
    b = Blob()
    b.from_proto(p)
    assert b.shape == (1, 2, 1, 3)
    assert b.shape_equals(p)
    np.testing.assert_array_equal(b.data.ravel(), range(6))


def test_from_proto_without_reshape_checks_shape():
    p = caffe_pb2.BlobProto()
    p.shape.dim.extend([2, 2])
    p.data.extend([1, 2, 3, 4])
    b = Blob((4,))
    with pytest.raises(ValueError):
        b.from_proto(p, reshape=False)


def test_to_proto_matches_protobuf_encoding():
    a = Blob((2, 2))
    a.data[...] = [[1.5, -2], [0, 3]]
    ref = caffe_pb2.BlobProto()
    ref.shape.dim.extend([2, 2])
    ref.data.extend([1.5, -2, 0, 3])
    assert a.to_proto().SerializeToString() == ref.SerializeToString()


def test_count_is_pycaffe_number_and_caffe_method():
    b = Blob((2, 3, 4))
    assert b.count == 24 and b.count() == 24 and b.count(1) == 12 and b.count(1, 2) == 3
    assert isinstance(b.count, int) and b.count + 1 == 25


def test_cached_views_follow_reshape_sharing_and_user_shape_changes():
    b = Blob((2, 3))
    v = b.data
    assert b.data is v  # same buffer, same shape: the cached view
    b.reshape((3, 2))
    assert b.data.shape == (3, 2)
    v2 = b.data
    v2.shape = (6,)  # a user reshaping the view in place must not leak into the blob
    assert b.data.shape == (3, 2)
    other = Blob((3, 2))
    other.data[...] = 7
    b.share_data(other)
    assert (b.data == 7).all()
    b.drop_views()
    assert (b.data == 7).all()
