"""RNN, LSTM and LSTMUnit: Caffe's parameter shapes and order, forward against naive
loops and torch.nn.LSTM/RNN, float64 gradient checks, cont semantics, state carried
between forwards, expose_hidden, errors, GPU parity."""
import logging

import numpy as np
import pytest

from minicaffe.core import context
from minicaffe.core.blob import Blob
from minicaffe.core.errors import LayerError
from minicaffe.compat.testing import check_gradient, layer_param, make_blob, make_layer
from minicaffe.layers.registry import create_layer


def rs(seed):
    return np.random.RandomState(seed)


def blob(values, dtype=np.float64):
    values = np.asarray(values)
    return make_blob(values.shape, dtype=dtype, values=values)


def lstm_text(H=3, extra=""):
    return (f'type: "LSTM" recurrent_param {{ num_output: {H} '
            f'weight_filler {{ type: "uniform" min: -0.5 max: 0.5 }} '
            f'bias_filler {{ type: "uniform" min: -0.5 max: 0.5 }} {extra} }}')


def rnn_text(H=3, extra=""):
    return lstm_text(H, extra).replace('"LSTM"', '"RNN"')


def setup(text, bottoms, ntop=1):
    layer = make_layer(text)
    top = [Blob(dtype=bottoms[0].dtype) for _ in range(ntop)]
    layer.setup(bottoms, top)
    return layer, top


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


# -- naive references (one stream at a time, one gate at a time) -----------------------

def naive_lstm(x, cont, W_xc, b_c, W_hc, h0, c0, W_s=None, xs=None):
    T, N = cont.shape
    H = W_hc.shape[1]
    xf = x.reshape(T, N, -1)
    h_out = np.zeros((T, N, H))
    hT, cT = np.zeros((N, H)), np.zeros((N, H))
    for n in range(N):
        h, c = h0[n].copy(), c0[n].copy()
        for t in range(T):
            pre = W_xc @ xf[t, n] + b_c + W_hc @ (cont[t, n] * h)
            if W_s is not None:
                pre = pre + W_s @ xs[n].ravel()
            i, f, o = sigmoid(pre[:H]), sigmoid(pre[H:2 * H]), sigmoid(pre[2 * H:3 * H])
            g = np.tanh(pre[3 * H:])
            c = cont[t, n] * f * c + i * g
            h = o * np.tanh(c)
            h_out[t, n] = h
        hT[n], cT[n] = h, c
    return h_out, hT, cT


def naive_rnn(x, cont, W_xh, b_h, W_hh, W_ho, b_o, h0, W_s=None, xs=None):
    T, N = cont.shape
    H = W_hh.shape[0]
    xf = x.reshape(T, N, -1)
    o = np.zeros((T, N, H))
    hT = np.zeros((N, H))
    for n in range(N):
        h = h0[n].copy()
        for t in range(T):
            pre = W_xh @ xf[t, n] + b_h + W_hh @ (cont[t, n] * h)
            if W_s is not None:
                pre = pre + W_s @ xs[n].ravel()
            h = np.tanh(pre)
            o[t, n] = np.tanh(W_ho @ h + b_o)
        hT[n] = h
    return o, hT


def seq_bottoms(T=4, N=3, feat=(2, 2), seed=0, cont=None):
    x = blob(rs(seed).randn(T, N, *feat))
    if cont is None:
        cont = np.ones((T, N))
        cont[0] = 0
        if T > 2 and N > 1:
            cont[2, 1] = 0    # stream 1 starts a new sequence at t = 2
    return x, blob(cont)


# -- parameters ------------------------------------------------------------------------------

def test_lstm_param_shapes_and_order():
    x, cont = seq_bottoms()
    layer, top = setup(lstm_text(5), [x, cont])
    assert [b.shape for b in layer.blobs] == [(20, 4), (20,), (20, 5)]
    assert top[0].shape == (4, 3, 5)
    xs = blob(rs(1).randn(3, 6))
    layer, _ = setup(lstm_text(5), [x, cont, xs])
    assert [b.shape for b in layer.blobs] == [(20, 4), (20,), (20, 6), (20, 5)]
    assert layer.param_names() == ["W_xc", "b_c", "W_xc_static", "W_hc"]


def test_rnn_param_shapes_and_order():
    x, cont = seq_bottoms()
    layer, top = setup(rnn_text(5), [x, cont])
    assert [b.shape for b in layer.blobs] == [(5, 4), (5,), (5, 5), (5, 5), (5,)]
    assert top[0].shape == (4, 3, 5)
    xs = blob(rs(1).randn(3, 6))
    layer, _ = setup(rnn_text(5), [x, cont, xs])
    assert layer.param_names() == ["W_xh", "b_h", "W_xh_static", "W_hh", "W_ho", "b_o"]
    assert [b.shape for b in layer.blobs] == [(5, 4), (5,), (5, 6), (5, 5), (5, 5), (5,)]


def test_fillers_apply_to_weights_and_biases():
    x, cont = seq_bottoms()
    layer, _ = setup('type: "LSTM" recurrent_param { num_output: 2 weight_filler { type: '
                     '"constant" value: 0.25 } bias_filler { type: "constant" value: -1 } }',
                     [x, cont])
    W_xc, b_c, W_hc = (b.data for b in layer.blobs)
    assert (W_xc == 0.25).all() and (W_hc == 0.25).all() and (b_c == -1).all()


def test_blobs_from_layer_param_are_used():
    x, cont = seq_bottoms()
    layer, top = setup(lstm_text(2), [x, cont])
    layer.forward([x, cont], top)
    saved = layer.to_proto()
    other = create_layer(saved)
    top2 = [Blob(dtype=np.float64)]
    other.setup([x, cont], top2)
    for a, b in zip(layer.blobs, other.blobs):
        np.testing.assert_allclose(b.data, a.data.astype(np.float32), rtol=0)
    layer.reset()
    layer.forward([x, cont], top)
    other.forward([x, cont], top2)
    np.testing.assert_allclose(top2[0].data, top[0].data, rtol=1e-6, atol=1e-6)


# -- forward against references -----------------------------------------------------------

def test_lstm_forward_matches_naive_loop_with_static_input():
    x, cont = seq_bottoms()
    xs = blob(rs(2).randn(3, 2, 1))
    layer, top = setup(lstm_text(3), [x, cont, xs])
    layer.forward([x, cont, xs], top)
    W_xc, b_c, W_s, W_hc = (b.data for b in layer.blobs)
    z = np.zeros((3, 3))
    ref, _, _ = naive_lstm(x.data, cont.data, W_xc, b_c, W_hc, z, z, W_s, xs.data)
    np.testing.assert_allclose(top[0].data, ref, rtol=1e-12, atol=1e-14)


def test_rnn_forward_matches_naive_loop_with_static_input():
    x, cont = seq_bottoms()
    xs = blob(rs(2).randn(3, 2))
    layer, top = setup(rnn_text(3), [x, cont, xs])
    layer.forward([x, cont, xs], top)
    W_xh, b_h, W_s, W_hh, W_ho, b_o = (b.data for b in layer.blobs)
    ref, _ = naive_rnn(x.data, cont.data, W_xh, b_h, W_hh, W_ho, b_o, np.zeros((3, 3)),
                       W_s, xs.data)
    np.testing.assert_allclose(top[0].data, ref, rtol=1e-12, atol=1e-14)


def _torch_gate_order(W, H):
    # Caffe (i, f, o, g) -> torch (i, f, g, o)
    return np.concatenate([W[:H], W[H:2 * H], W[3 * H:], W[2 * H:3 * H]])


def test_lstm_forward_backward_against_torch():
    torch = pytest.importorskip("torch")
    T, N, I, H = 5, 3, 4, 3
    x = blob(rs(3).randn(T, N, I))
    cont = blob(np.ones((T, N)))
    h0, c0 = blob(rs(4).randn(1, N, H)), blob(rs(5).randn(1, N, H))
    layer, top = setup(lstm_text(H, "expose_hidden: true"), [x, cont, h0, c0], ntop=3)
    layer.forward([x, cont, h0, c0], top)
    dh, dhT, dcT = rs(6).randn(T, N, H), rs(7).randn(1, N, H), rs(8).randn(1, N, H)
    top[0].diff[...], top[1].diff[...], top[2].diff[...] = dh, dhT, dcT
    layer.backward(top, [True, False, True, True], [x, cont, h0, c0])

    W_xc, b_c, W_hc = (b.data for b in layer.blobs)
    lstm = torch.nn.LSTM(I, H).double()
    with torch.no_grad():
        lstm.weight_ih_l0.copy_(torch.tensor(_torch_gate_order(W_xc, H)))
        lstm.weight_hh_l0.copy_(torch.tensor(_torch_gate_order(W_hc, H)))
        lstm.bias_ih_l0.copy_(torch.tensor(_torch_gate_order(b_c, H)))
        lstm.bias_hh_l0.zero_()
    tx = torch.tensor(x.data, requires_grad=True)
    th0 = torch.tensor(h0.data, requires_grad=True)
    tc0 = torch.tensor(c0.data, requires_grad=True)
    out, (hT, cT) = lstm(tx, (th0, tc0))
    np.testing.assert_allclose(top[0].data, out.detach().numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(top[1].data, hT.detach().numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(top[2].data, cT.detach().numpy(), rtol=1e-10, atol=1e-12)
    obj = (out * torch.tensor(dh)).sum() + (hT * torch.tensor(dhT)).sum() + \
        (cT * torch.tensor(dcT)).sum()
    obj.backward()
    tol = dict(rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(x.diff, tx.grad.numpy(), **tol)
    np.testing.assert_allclose(h0.diff, th0.grad.numpy(), **tol)
    np.testing.assert_allclose(c0.diff, tc0.grad.numpy(), **tol)
    np.testing.assert_allclose(_torch_gate_order(layer.blobs[0].diff, H),
                               lstm.weight_ih_l0.grad.numpy(), **tol)
    np.testing.assert_allclose(_torch_gate_order(layer.blobs[1].diff, H),
                               lstm.bias_ih_l0.grad.numpy(), **tol)
    np.testing.assert_allclose(_torch_gate_order(layer.blobs[2].diff, H),
                               lstm.weight_hh_l0.grad.numpy(), **tol)


def test_rnn_forward_against_torch():
    torch = pytest.importorskip("torch")
    T, N, I, H = 5, 2, 3, 4
    x = blob(rs(3).randn(T, N, I))
    cont = blob(np.ones((T, N)))
    h0 = blob(rs(4).randn(1, N, H))
    layer, top = setup(rnn_text(H, "expose_hidden: true"), [x, cont, h0], ntop=2)
    layer.forward([x, cont, h0], top)
    W_xh, b_h, W_hh, W_ho, b_o = (torch.tensor(b.data) for b in layer.blobs)
    rnn = torch.nn.RNN(I, H).double()
    with torch.no_grad():
        rnn.weight_ih_l0.copy_(W_xh)
        rnn.weight_hh_l0.copy_(W_hh)
        rnn.bias_ih_l0.copy_(b_h)
        rnn.bias_hh_l0.zero_()
    hs, hT = rnn(torch.tensor(x.data), torch.tensor(h0.data))
    o = torch.tanh(hs @ W_ho.T + b_o)
    np.testing.assert_allclose(top[0].data, o.detach().numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(top[1].data, hT.detach().numpy(), rtol=1e-10, atol=1e-12)


# -- gradients -------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["LSTM", "RNN"])
@pytest.mark.parametrize("static", [False, True])
def test_gradient(kind, static):
    x, cont = seq_bottoms(T=3, N=2, feat=(3,))
    bottoms = [x, cont] + ([blob(rs(9).randn(2, 2))] if static else [])
    text = (lstm_text if kind == "LSTM" else rnn_text)(2)
    layer = make_layer(text)
    n = check_gradient(layer, bottoms, [Blob(dtype=np.float64)],
                       check_bottom=[0] + ([2] if static else []))
    assert n == sum(b.count() for b in layer.blobs) + x.count() + (4 if static else 0)


@pytest.mark.parametrize("kind", ["LSTM", "RNN"])
def test_gradient_expose_hidden(kind):
    x, cont = seq_bottoms(T=3, N=2, feat=(2,), cont=np.array([[1, 1], [1, 0], [1, 1.]]))
    states = [blob(rs(10 + j).randn(1, 2, 2)) for j in range(2 if kind == "LSTM" else 1)]
    text = (lstm_text if kind == "LSTM" else rnn_text)(2, "expose_hidden: true")
    layer = make_layer(text)
    tops = [Blob(dtype=np.float64) for _ in range(1 + len(states))]
    check_gradient(layer, [x, cont] + states, tops,
                   check_bottom=[0] + [2 + j for j in range(len(states))])


def test_lstm_unit_forward_and_gradient():
    N, H = 3, 2
    c_prev = blob(rs(1).randn(1, N, H))
    gates = blob(rs(2).randn(1, N, 4 * H))
    cont = blob(np.array([[1.0, 0.0, 1.0]]))
    layer = make_layer('type: "LSTMUnit"')
    tops = [Blob(dtype=np.float64), Blob(dtype=np.float64)]
    layer.setup([c_prev, gates, cont], tops)
    layer.forward([c_prev, gates, cont], tops)
    X = gates.data[0]
    i, f, o = sigmoid(X[:, :H]), sigmoid(X[:, H:2 * H]), sigmoid(X[:, 2 * H:3 * H])
    g = np.tanh(X[:, 3 * H:])
    c = cont.data[0][:, None] * f * c_prev.data[0] + i * g
    np.testing.assert_allclose(tops[0].data[0], c, rtol=1e-12)
    np.testing.assert_allclose(tops[1].data[0], o * np.tanh(c), rtol=1e-12)
    check_gradient(layer, [c_prev, gates, cont], tops, check_bottom=[0, 1], setup=False)
    with pytest.raises(LayerError, match="sequence indicators"):
        layer.backward(tops, [True, True, True], [c_prev, gates, cont])
    with pytest.raises(LayerError, match="4 \\* 2"):
        layer.setup([c_prev, blob(np.zeros((1, N, 6))), cont], tops)


# -- cont and carried state ---------------------------------------------------------------------

@pytest.mark.parametrize("text", [lstm_text(3), rnn_text(3)])
def test_state_carries_between_forwards(text):
    T, N = 3, 2
    x_all = rs(11).randn(2 * T, N, 2)
    cont_all = np.ones((2 * T, N))
    cont_all[0] = 0
    # one pass over 2T steps ...
    x2, c2 = blob(x_all), blob(cont_all)
    long_layer, long_top = setup(text, [x2, c2])
    long_layer.forward([x2, c2], long_top)
    # ... equals two passes over T steps with the same weights (cont = 1 at the seam)
    xa, ca = blob(x_all[:T]), blob(cont_all[:T])
    layer, top = setup(text, [xa, ca])
    for mine, theirs in zip(layer.blobs, long_layer.blobs):
        mine.data[...] = theirs.data
    layer.forward([xa, ca], top)
    first = top[0].data.copy()
    xb, cb = blob(x_all[T:]), blob(cont_all[T:])
    layer.forward([xb, cb], top)
    np.testing.assert_allclose(first, long_top[0].data[:T], rtol=1e-12)
    np.testing.assert_allclose(top[0].data, long_top[0].data[T:], rtol=1e-12)
    # cont = 0 at t = 0 forgets the carried state; reset() does the same
    cb.data[0] = 0
    layer.forward([xb, cb], top)
    fresh = top[0].data.copy()
    layer.reset()
    cb.data[0] = 1
    layer.forward([xb, cb], top)
    np.testing.assert_allclose(top[0].data, fresh, rtol=1e-12)


def test_batch_size_change_resets_state_and_timesteps_may_change():
    x, cont = seq_bottoms(T=3, N=2, feat=(2,), cont=np.ones((3, 2)))
    layer, top = setup(lstm_text(2), [x, cont])
    layer.forward([x, cont], top)
    x3, c3 = seq_bottoms(T=5, N=4, feat=(2,), cont=np.ones((5, 4)))
    layer.forward([x3, c3], top)
    assert top[0].shape == (5, 4, 2)
    W_xc, b_c, W_hc = (b.data for b in layer.blobs)
    z = np.zeros((4, 2))
    ref, _, _ = naive_lstm(x3.data, c3.data, W_xc, b_c, W_hc, z, z)
    np.testing.assert_allclose(top[0].data, ref, rtol=1e-12)


# -- backward bookkeeping -------------------------------------------------------------------

@pytest.mark.parametrize("text", [lstm_text(2), rnn_text(2)])
def test_param_diffs_accumulate_and_propagate_down(text):
    x, cont = seq_bottoms(T=3, N=2, feat=(2,))
    layer, top = setup(text, [x, cont])
    layer.forward([x, cont], top)
    top[0].diff[...] = rs(12).randn(*top[0].shape)
    x.diff[...] = 5.0
    layer.backward(top, [False, False], [x, cont])
    assert (x.diff == 5.0).all()
    once = [b.diff.copy() for b in layer.blobs]
    assert all(np.abs(d).max() > 0 for d in once)
    layer.backward(top, [True, False], [x, cont])
    for b, d in zip(layer.blobs, once):
        np.testing.assert_allclose(b.diff, 2 * d, rtol=1e-12)
    assert np.abs(x.diff - 5.0).max() > 0
    layer.set_param_propagate_down(0, False)
    layer.backward(top, [True, False], [x, cont])
    np.testing.assert_allclose(layer.blobs[0].diff, 2 * once[0], rtol=1e-12)
    np.testing.assert_allclose(layer.blobs[1].diff, 3 * once[1], rtol=1e-12)
    with pytest.raises(LayerError, match="sequence indicators"):
        layer.backward(top, [True, True], [x, cont])


def test_debug_info_logs(caplog):
    from minicaffe.core import log
    x, cont = seq_bottoms(T=2, N=1, feat=(2,))
    layer, top = setup(lstm_text(2, "debug_info: true"), [x, cont])
    logger = logging.getLogger("minicaffe")
    old = logger.level
    logger.setLevel(logging.INFO)
    logger.propagate = True
    try:
        with caplog.at_level(logging.INFO, logger="minicaffe"):
            layer.forward([x, cont], top)
            layer.backward(top, [True, False], [x, cont])
    finally:
        logger.propagate = False
        logger.setLevel(old)
    text = caplog.text
    assert "[Forward] Layer test_lstm_unit_2, top blob h_2 data:" in text
    assert "[Backward] Layer test_lstm_unit_1, bottom blob gate_input_1 diff:" in text
    assert log is not None


# -- errors -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("text,shapes,ntop,match", [
    (lstm_text(2), [(3, 2, 2), (3, 3)], 1, "cont"),
    (lstm_text(2), [(3, 2, 2), (3, 2, 1)], 1, "exactly 2 axes"),
    ('type: "LSTM" recurrent_param { num_output: 0 }', [(3, 2, 2), (3, 2)], 1,
     "num_output must be positive"),
    (lstm_text(2), [(3, 2, 2), (3, 2)], 2, "produces 1 top"),
    (lstm_text(2, "expose_hidden: true"), [(3, 2, 2), (3, 2), (1, 2, 2)], 3, "do not fit"),
    (lstm_text(2, "expose_hidden: true"), [(3, 2, 2), (3, 2), (1, 2, 2), (1, 2, 3)], 3,
     "hidden state input shape: 1 2 2"),
    (rnn_text(2), [(3, 2, 2), (3, 2), (3, 4)], 1, "static input"),
    (rnn_text(2), [(3,), (3, 2)], 1, "at least 2 axes"),
])
def test_bad_configuration_is_one_line_error(text, shapes, ntop, match):
    bottoms = [blob(np.ones(s)) for s in shapes]
    with pytest.raises(LayerError, match=match) as e:
        setup(text, bottoms, ntop)
    assert "\n" not in str(e.value)


def test_input_size_change_is_refused():
    x, cont = seq_bottoms(T=3, N=2, feat=(2,))
    layer, top = setup(lstm_text(2), [x, cont])
    x2, c2 = seq_bottoms(T=3, N=2, feat=(3,))
    with pytest.raises(LayerError, match="input size changed"):
        layer.forward([x2, c2], top)


def test_wrong_param_blob_shape_is_refused():
    x, cont = seq_bottoms(T=3, N=2, feat=(2,))
    p = layer_param(lstm_text(2))
    for s in [(8, 2), (8,), (8, 3)]:
        Blob(s).to_proto(p.blobs.add())
    with pytest.raises(LayerError, match="W_hc has shape"):
        create_layer(p).setup([x, cont], [Blob(dtype=np.float64)])


# -- in a Net -------------------------------------------------------------------------------------

NET = """
name: "seq"
layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 4 dim: 2 dim: 3 } } }
layer { name: "cont" type: "Input" top: "cont" input_param { shape { dim: 4 dim: 2 } } }
layer { name: "target" type: "Input" top: "target" input_param { shape { dim: 4 dim: 2 dim: 2 } } }
layer { name: "lstm1" type: "LSTM" bottom: "x" bottom: "cont" top: "h"
        recurrent_param { num_output: 2 weight_filler { type: "uniform" min: -0.3 max: 0.3 } } }
layer { name: "loss" type: "EuclideanLoss" bottom: "h" bottom: "target" top: "loss" }
"""


def test_lstm_in_a_net_trains_saves_and_loads(tmp_path):
    from minicaffe.network.net import Net, TRAIN
    path = tmp_path / "seq.prototxt"
    path.write_text(NET)
    net = Net(str(path), TRAIN)
    assert [b.shape for b in net.params["lstm1"]] == [(8, 3), (8,), (8, 2)]
    net.blobs["x"].data[...] = rs(13).randn(4, 2, 3)
    net.blobs["cont"].data[...] = 1
    net.blobs["cont"].data[0] = 0
    net.blobs["target"].data[...] = 0.5
    losses = []
    for _ in range(30):
        net.clear_param_diffs()
        losses.append(net.forward_backward())
        for b in net.learnable_params:
            b.data[...] -= 0.5 * b.diff
    assert losses[-1] < 0.5 * losses[0]
    weights = tmp_path / "seq.caffemodel"
    net.save(str(weights))
    net2 = Net(str(path), TRAIN, weights=str(weights))
    for a, b in zip(net.params["lstm1"], net2.params["lstm1"]):
        np.testing.assert_array_equal(a.data, b.data)


# -- GPU parity ---------------------------------------------------------------------------------

def _run_mode(text, values, ntop, check, params, gpu):
    if gpu:
        context.set_mode_gpu()
    bottoms = [make_blob(v.shape, dtype=np.float32, values=v) for v in values]
    layer = make_layer(text)
    tops = [Blob(dtype=np.float32) for _ in range(ntop)]
    layer.setup(bottoms, tops)
    for b, p in zip(layer.blobs, params):
        b.data[...] = p
    for k in range(2):     # the second forward uses the carried state
        layer.forward(bottoms, tops)
    for j, t in enumerate(tops):
        t.diff[...] = rs(20 + j).randn(*t.shape)
    layer.backward(tops, [i in check for i in range(len(bottoms))], bottoms)
    out = [t.data.copy() for t in tops] + [bottoms[i].diff.copy() for i in check] + \
        [b.diff.copy() for b in layer.blobs]
    context.set_mode_cpu()
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["LSTM", "LSTM_static_exposed", "RNN", "RNN_exposed", "LSTMUnit"])
def test_gpu_parity(case):
    T, N, H = 6, 5, 8
    x = rs(1).randn(T, N, 7)
    cont = np.ones((T, N))
    cont[3, 2] = 0
    if case == "LSTMUnit":
        text = 'type: "LSTMUnit"'
        values = [rs(2).randn(1, N, H), rs(3).randn(1, N, 4 * H), cont[3:4]]
        ntop, check, params = 2, [0, 1], []
    else:
        kind = case.split("_")[0]
        static = "static" in case
        exposed = "exposed" in case
        text = (lstm_text if kind == "LSTM" else rnn_text)(H, "expose_hidden: true" if exposed
                                                          else "")
        values = [x, cont] + ([rs(4).randn(N, 3)] if static else [])
        n_state = 2 if kind == "LSTM" else 1
        if exposed:
            values += [rs(5 + j).randn(1, N, H) for j in range(n_state)]
        ntop = 1 + (n_state if exposed else 0)
        check = [0] + ([2] if static else []) + \
            ([len(values) - n_state + j for j in range(n_state)] if exposed else [])
        probe = make_layer(text)
        probe.setup([make_blob(v.shape, dtype=np.float32, values=v) for v in values],
                    [Blob() for _ in range(ntop)])
        params = [rs(30 + j).uniform(-0.5, 0.5, b.shape) for j, b in enumerate(probe.blobs)]
    cpu = _run_mode(text, values, ntop, check, params, gpu=False)
    gpu = _run_mode(text, values, ntop, check, params, gpu=True)
    for c, g in zip(cpu, gpu):
        np.testing.assert_allclose(g, c, rtol=1e-5, atol=1e-5)
