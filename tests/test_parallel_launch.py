"""Process mode on the CPU: the launcher's supervision with stand-in children, and
train_rank (one rank of a run of one process per GPU) with threads standing in for the
processes, a FakeComm and the file channel of --init_file."""
import os
import signal
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from minicaffe.multigpu import parallel
from minicaffe.multigpu.comm import FakeComm
from minicaffe.core.errors import MinicaffeError
from minicaffe.multigpu.parallel_launch import FileAbortChannel, file_uid, launch, train_rank

from test_parallel import assert_same_weights, single_rank, solver_param, weights

CHILD = textwrap.dedent("""
    import os, signal, sys, time
    from minicaffe.multigpu.parallel_launch import FileAbortChannel
    init, rank, what = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    ch = FileAbortChannel(init)
    def wait_for_abort():
        while ch.poll() is None:
            time.sleep(0.02)
        sys.exit(1)
    if what == "ok":
        sys.exit(0)
    if what == "fail" and rank == 1:
        time.sleep(0.2); ch.signal("rank 1 (GPU 1): boom"); sys.exit(1)
    if what == "kill" and rank == 1:
        time.sleep(0.2); os.kill(os.getpid(), signal.SIGKILL)
    if what == "hang" and rank == 1:
        time.sleep(0.2); ch.signal("rank 1 (GPU 1): boom"); sys.exit(1)
    if what == "hang":
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        while True:      # never ends by itself: only the launcher's SIGTERM ends it
            time.sleep(1)
    if what == "sigint":
        got = []
        signal.signal(signal.SIGINT, lambda s, f: got.append(s))
        open(init + ".up.%d" % rank, "w").close()
        while not got:
            time.sleep(0.02)
        open(init + ".sigint.%d" % rank, "w").close()
        sys.exit(0)
    wait_for_abort()
""")


def argvs(tmp_path, what, n=3):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    init = str(tmp_path / "init")
    return [[sys.executable, str(script), init, str(r), what] for r in range(n)], init


def test_launch_all_ok_cleans_up(tmp_path):
    a, init = argvs(tmp_path, "ok")
    open(init, "w").close()
    assert launch(a, init) == (0, None)
    assert not os.path.exists(init)


def test_launch_one_failure_ends_every_child_with_its_message(tmp_path, finishes):
    a, init = argvs(tmp_path, "fail")
    with finishes():
        rc, msg = launch(a, init)
    assert rc == 1 and msg == "rank 1 (GPU 1): boom"
    assert not os.path.exists(init + ".abort")


def test_launch_a_killed_child_is_reported_and_the_others_end(tmp_path, finishes):
    a, init = argvs(tmp_path, "kill")
    with finishes():
        rc, msg = launch(a, init)
    assert rc == 1 and msg == "rank 1: exited on signal SIGKILL"


def test_launch_terminates_children_that_do_not_end(tmp_path, finishes):
    a, init = argvs(tmp_path, "hang")
    with finishes():
        rc, msg = launch(a, init, grace_s=1.0)
    assert rc == 1 and msg == "rank 1 (GPU 1): boom"


def test_launch_forwards_sigint_once_to_every_child(tmp_path):
    a, init = argvs(tmp_path, "sigint", n=2)

    def interrupt():
        while not all(os.path.exists(f"{init}.up.{r}") for r in range(2)):
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGINT)
    threading.Thread(target=interrupt, daemon=True).start()
    assert launch(a, init) == (0, None)
    assert all(os.path.exists(f"{init}.sigint.{r}") for r in range(2))


# -- train_rank: threads stand in for the processes ------------------------------------------
def run_processes(tmp_path, param, n, fail_rank=None, monkeypatch=None):
    init = str(tmp_path / "nccl_id")
    world = FakeComm.new_uid(n)
    out, errs = [None] * n, [None] * n

    def body(r):
        try:
            def share(kind):  # the id still travels through the file; FakeComm's is the world
                file_uid(init, r)(type("K", (), {"new_uid": staticmethod(lambda s: b"id")}))
                return world
            out[r] = train_rank(param, None, r, n, None, share, FileAbortChannel(init),
                                comm_kind=FakeComm)
        except Exception as e:
            errs[r] = e
    ts = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert not any(t.is_alive() for t in ts), "a rank hung"
    return out, errs, init


def test_process_ranks_train_as_one_rank_would(tmp_path):
    param = solver_param(tmp_path, batch=12, max_iter=5)
    ref_w, ref_scores, _ = single_rank(param)
    out, errs, init = run_processes(tmp_path, param, 2)
    assert errs == [None, None]
    root = out[0].syncs[0].solver
    assert out[1].syncs[0].rank == 1 and out[1].syncs[0].solver.iter == 5
    assert_same_weights(weights(root.net), ref_w)
    np.testing.assert_allclose(root.mean_scores[0], ref_scores[0], rtol=1e-4, atol=1e-6)
    assert os.path.exists(init) and not os.path.exists(init + ".abort")


def test_a_process_failing_before_training_stops_the_others(tmp_path, monkeypatch, finishes):
    param = solver_param(tmp_path, max_iter=5)
    from minicaffe.core import context
    from minicaffe import solvers
    orig = solvers.sgd_solvers.SGDSolver.pre_solve

    def pre_solve(self):
        if context.solver_rank() == 1:
            raise MinicaffeError("cannot open the data of rank 1")
        orig(self)
    monkeypatch.setattr(solvers.sgd_solvers.SGDSolver, "pre_solve", pre_solve)
    with finishes():
        out, errs, init = run_processes(tmp_path, param, 2)
    assert all(isinstance(e, parallel.ParallelError) for e in errs)
    assert str(errs[0]) == str(errs[1]) == "rank 1 (CPU): cannot open the data of rank 1"
    assert FileAbortChannel(init).poll() == "rank 1 (CPU): cannot open the data of rank 1"


def test_a_process_failing_while_training_stops_the_others(tmp_path, monkeypatch):
    param = solver_param(tmp_path, max_iter=10000, test_interval=0)
    param.ClearField("test_iter")
    orig = parallel.P2PSync.on_start

    def on_start(self):
        if self.rank == 0 and self.solver.iter == 4:
            raise MinicaffeError("disk full")
        orig(self)
    monkeypatch.setattr(parallel.P2PSync, "on_start", on_start)
    out, errs, init = run_processes(tmp_path, param, 2)
    assert str(errs[0]) == "rank 0 (CPU): disk full"
    assert isinstance(errs[1], parallel.ParallelError) and "disk full" in str(errs[1])


# -- the CLI's wiring (no GPU here: the GPU checks and the runs themselves are stubbed) -------
SOLVER_FILE = 'net: "net.prototxt" base_lr: 0.1 max_iter: 1 solver_mode: CPU'


@pytest.fixture
def cli_stubs(tmp_path, monkeypatch):
    from minicaffe.core import backend
    from minicaffe.multigpu import parallel_launch
    monkeypatch.chdir(tmp_path)
    (tmp_path / "s.prototxt").write_text(SOLVER_FILE)
    monkeypatch.setattr(backend, "gpu_count", lambda: 2)
    monkeypatch.setattr(parallel_launch, "check_multi_gpu", lambda gpus: None)
    calls = {}
    monkeypatch.setattr(parallel_launch, "launch",
                        lambda argvs, init: calls.setdefault("launch", (argvs, init)) and (0, None))
    import minicaffe.multigpu.parallel as par
    monkeypatch.setattr(par, "train_threads", lambda *a, **k: calls.setdefault("threads", (a, k)))
    monkeypatch.setattr(parallel_launch, "train_rank",
                        lambda *a, **k: calls.setdefault("rank", (a, k)))
    return calls


def test_cli_parallel_process_starts_one_child_per_gpu(cli_stubs):
    from minicaffe.cli import main
    assert main(["train", "--solver", "s.prototxt", "--gpu", "0,1", "--parallel", "process",
                 "--sigint_effect", "snapshot", "--log", "run.log"]) == 0
    argvs, init = cli_stubs["launch"]
    assert "threads" not in cli_stubs and len(argvs) == 2
    for r, argv in enumerate(argvs):
        i = argv.index
        assert argv[argv.index("--rank") + 1] == str(r) and argv[i("--gpu") + 1] == str(r)
        assert argv[i("--world_size") + 1] == "2" and argv[i("--init_file") + 1] == init
        assert argv[i("--sigint_effect") + 1] == "snapshot"
        assert ("--log" in argv) == (r == 0)           # only rank 0 writes the log file


def test_cli_process_ranks_get_the_runs_flags(cli_stubs):
    """Each rank reads the solver file again: the flags that override it (--precision,
    --tf32, --nocuda_graph, --offload, --gpu_mem_limit, --gpu_decode) reach every rank."""
    from minicaffe.cli import main
    assert main(["train", "--solver", "s.prototxt", "--gpu", "0,1", "--parallel", "process",
                 "--precision", "bf16", "--tf32", "--nocuda_graph", "--offload", "ALL",
                 "--gpu_mem_limit", "12GiB", "--gpu_decode", "--noshare_data"]) == 0
    argvs, _ = cli_stubs["launch"]
    for argv in argvs:
        assert argv[argv.index("--precision") + 1] == "bf16"
        assert argv[argv.index("--offload") + 1] == "ALL"
        assert argv[argv.index("--gpu_mem_limit") + 1] in ("12GiB", str(12 << 30))
        assert "--tf32" in argv and "--nocuda_graph" in argv and "--gpu_decode" in argv
        assert "--noshare_data" in argv
    cli_stubs.pop("launch")
    assert main(["train", "--solver", "s.prototxt", "--gpu", "0,1", "--parallel",
                 "process"]) == 0
    for argv in cli_stubs["launch"][0]:
        assert not {"--precision", "--tf32", "--nocuda_graph", "--offload"} & set(argv)


def test_cli_default_is_thread_mode(cli_stubs):
    from minicaffe.cli import main
    assert main(["train", "--solver", "s.prototxt", "--gpu", "all"]) == 0
    (param, gpus, source), k = cli_stubs["threads"]
    assert gpus == [0, 1] and source.endswith("s.prototxt") and "launch" not in cli_stubs


def test_cli_rank_flags_run_one_rank_on_its_gpu(cli_stubs, monkeypatch):
    from minicaffe.cli import main
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert main(["train", "--solver", "s.prototxt", "--gpu", "0,1", "--rank", "3",
                 "--world_size", "4", "--init_file", "id"]) == 0
    (param, source, rank, size, device, share, channel), k = cli_stubs["rank"]
    assert (rank, size, device) == (3, 4, 1)                # the GPU of local rank 1
    from minicaffe.core import context
    assert context.solver_rank() == 0                        # restored after the run
    assert isinstance(channel, FileAbortChannel) and channel.init_file == "id"
