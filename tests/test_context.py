import threading

import numpy as np
import pytest

from minicaffe.core import backend, context
from minicaffe.core.errors import MinicaffeError


def test_same_seed_same_numbers():
    context.set_random_seed(42)
    a = context.rng().uniform(size=5)
    context.set_random_seed(42)
    b = context.rng().uniform(size=5)
    np.testing.assert_array_equal(a, b)


def test_rng_is_mersenne_twister():
    context.set_random_seed(5)
    assert isinstance(context.rng(), np.random.RandomState)
    np.testing.assert_array_equal(context.rng().randint(0, 2**31, 3),
                                  np.random.RandomState(5).randint(0, 2**31, 3))


def test_new_thread_sees_defaults_not_main_settings():
    context.set_random_seed(7)
    context.set_solver_rank(0)
    seen = {}

    def work():
        st = context.get()
        seen["mode"] = st.mode
        seen["seed"] = st.seed
        seen["rank"] = st.solver_rank
        seen["root"] = context.root_solver()

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert seen == {"mode": context.CPU, "seed": None, "rank": 0, "root": True}


def test_threads_have_independent_generators_and_ranks():
    out = {}
    barrier = threading.Barrier(2)

    def work(i):
        context.set_random_seed(100 + i)
        context.set_solver_rank(i)
        barrier.wait()
        out[i] = (context.rng().uniform(size=3), context.solver_rank(), context.root_solver())

    ts = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    np.testing.assert_array_equal(out[0][0], np.random.RandomState(100).uniform(size=3))
    np.testing.assert_array_equal(out[1][0], np.random.RandomState(101).uniform(size=3))
    assert out[0][1:] == (0, True) and out[1][1:] == (1, False)
    assert context.solver_rank() == 0


def test_solver_count_is_per_process():
    seen = []
    context.set_solver_count(3)
    try:
        t = threading.Thread(target=lambda: seen.append(context.solver_count()))
        t.start()
        t.join()
        assert seen == [3]
    finally:
        context.set_solver_count(1)


def test_gpu_mode_without_gpu_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(backend, "gpu_count", lambda: 0)
    with pytest.raises(MinicaffeError, match="no GPU"):
        context.set_mode_gpu()
    assert context.mode() == context.CPU


@pytest.mark.gpu
def test_set_device_renews_handles_and_gpu_rng():
    context.set_device(0)
    context.set_random_seed(3)
    a = context.gpu_rng().uniform(size=4)
    context.get().handles["x"] = 1
    context.set_device(0)
    assert context.get().handles == {}
    context.set_random_seed(3)
    b = context.gpu_rng().uniform(size=4)
    np.testing.assert_array_equal(backend.to_numpy(a), backend.to_numpy(b))
