import math

import numpy as np
import pytest

from minicaffe.core.blob import Blob
from minicaffe.core.errors import ConfigError
from minicaffe.core.filler import fill
from minicaffe.proto import caffe_pb2


def filled(shape, **kw):
    b = Blob(shape)
    fill(b, caffe_pb2.FillerParameter(**kw))
    return b.data


def test_constant():
    assert (filled((3, 4), type="constant", value=2.5) == 2.5).all()


def test_uniform_range():
    d = filled((1000,), type="uniform", min=-2, max=3)
    assert d.min() >= -2 and d.max() <= 3 and abs(d.mean() - 0.5) < 0.2


def test_gaussian_moments():
    d = filled((200, 100), type="gaussian", mean=1, std=2)
    assert abs(d.mean() - 1) < 0.05 and abs(d.std() - 2) < 0.05


def test_sparse_gaussian_zero_fraction():
    d = filled((100, 50), type="gaussian", std=1, sparse=20)
    # each weight is non-zero with probability sparse / num_outputs = 0.2
    assert abs((d != 0).mean() - 0.2) < 0.02


def test_positive_unitball_rows_sum_to_one():
    d = filled((5, 3, 2), type="positive_unitball")
    np.testing.assert_allclose(d.reshape(5, -1).sum(1), 1, rtol=1e-5)
    assert (d >= 0).all()


@pytest.mark.parametrize("norm,n", [(0, 12), (1, 20), (2, 16)])
def test_xavier_and_msra_scales(norm, n):
    shape = (1000, 4, 3)  # fan_in = 12, fan_out = count / shape[1] = 3000 -> use other shape
    shape = (20, 12)       # fan_in 12, fan_out 20
    big = (20, 12)
    d = np.concatenate([filled(big, type="xavier", variance_norm=norm).ravel() for _ in range(200)])
    scale = math.sqrt(3.0 / n)
    assert d.max() <= scale and d.min() >= -scale and d.max() > 0.95 * scale
    m = np.concatenate([filled(big, type="msra", variance_norm=norm).ravel() for _ in range(200)])
    assert abs(m.std() - math.sqrt(2.0 / n)) < 0.02 * math.sqrt(2.0 / n) * 5


def test_bilinear_kernel():
    d = filled((1, 1, 4, 4), type="bilinear")
    # Caffe's upsampling-by-2 kernel: outer product of [0.25, 0.75, 0.75, 0.25]
    k = np.array([0.25, 0.75, 0.75, 0.25])
    np.testing.assert_allclose(d[0, 0], np.outer(k, k))


def test_unknown_filler_is_config_error():
    with pytest.raises(ConfigError, match="unknown filler"):
        filled((2,), type="nope")


def test_same_seed_same_weights():
    from minicaffe.core import context
    context.set_random_seed(9)
    a = filled((10,), type="gaussian").copy()
    context.set_random_seed(9)
    b = filled((10,), type="gaussian")
    np.testing.assert_array_equal(a, b)
