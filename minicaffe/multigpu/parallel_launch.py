"""Process mode: one process per GPU, on one machine or several.

Three ways to start it, all running :func:`train_rank` in each process:

- ``minicaffe train --solver S --gpu 0,1 --parallel process``: :func:`launch` starts one
  child process per GPU (``--rank r --world_size N --init_file F``, each in a session of
  its own), forwards SIGINT/SIGHUP to them, and ends them all when one fails;
- ``mpirun -np N minicaffe train --solver S --gpu all``: ranks from MPI (mpi4py, the
  optional ``.[mpi]`` extra), the NCCL id by MPI broadcast, the GPU from the local
  rank; a failing rank prints its error and calls MPI_Abort, which ends the job;
- by hand: ``minicaffe train --solver S --gpu G --rank R --world_size N --init_file F`` in
  each process (F on a file system every process sees; it must not exist yet).

Rank 0 writes the NCCL id to F; every process builds its solver, meets the others at a
file barrier, then runs a :class:`~minicaffe.multigpu.parallel.P2PManager` for its one rank.  A
failure is written to ``F.abort`` (the first message wins); every process watches that
file and aborts its communicator when it appears, so no rank waits in a collective.
"""
import os
import signal
import subprocess
import sys
import time

from ..core import context, log
from ..core.config import env as config_env
from .comm import CommAborted, FakeComm, NcclComm, share_uid_by_file, share_uid_by_mpi
from ..core.errors import MinicaffeError
from .parallel import P2PManager, ParallelError, prepare_solver_param, root_only_logging

LAUNCHED_ENV = "MINICAFFE_LAUNCHED"   # set by launch(): children leave the error line to it


class FileAbortChannel:
    """Failure messages and a start barrier through files next to the init file."""

    poll_s = 0.05

    def __init__(self, init_file):
        self.init_file = os.fspath(init_file)
        self.path = self.init_file + ".abort"

    def signal(self, message):
        """Publish ``message`` unless another rank's failure came first (atomic: a complete
        temporary file is linked into place, which fails if the name exists)."""
        tmp = f"{self.path}.tmp-{os.getpid()}-{id(message)}"
        with open(tmp, "w") as f:
            f.write(message)
        try:
            os.link(tmp, self.path)
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)

    def poll(self):
        try:
            with open(self.path) as f:
                return f.read()
        except FileNotFoundError:
            return None

    def barrier(self, rank, size, timeout=600.0):
        """Wait until every rank has called this (or a failure is published)."""
        open(f"{self.init_file}.ready.{rank}", "w").close()
        deadline = time.monotonic() + timeout
        while True:
            msg = self.poll()
            if msg is not None:
                raise CommAborted(msg)
            if all(os.path.exists(f"{self.init_file}.ready.{r}") for r in range(size)):
                return
            if time.monotonic() > deadline:
                raise MinicaffeError(f"rank {rank} waited {timeout:.0f} s for the other ranks "
                                     f"to start (--init_file {self.init_file})")
            time.sleep(self.poll_s)

    def cleanup(self, size):
        for p in [self.init_file, self.path] + [f"{self.init_file}.ready.{r}" for r in range(size)]:
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass


class MpiAbortChannel:
    """Under mpirun: a failure is printed and ends the job by MPI_Abort."""

    def __init__(self, world):
        self.world = world

    def signal(self, message):
        print(f"minicaffe: error: {message}", file=sys.stderr, flush=True)
        log.error("%s", message)
        self.world.Abort(1)

    def poll(self):
        return None

    def barrier(self, rank, size, timeout=None):
        self.world.Barrier()

    def cleanup(self, size):
        pass


def train_rank(param, source, rank, world_size, device, share_uid, channel, snapshot=None,
               weights=None, action_function=None, comm_kind=None, config=None):
    """This process's rank of a process-mode run (see the module docstring).  ``share_uid``
    makes or fetches the communicator's id; ``channel`` is a File/MpiAbortChannel.  Returns
    the P2PManager; raises ParallelError naming the rank that failed."""
    from ..solvers import solver_class
    solver = None
    where = f"rank {rank} ({'GPU %d' % device if device is not None else 'CPU'})"
    with root_only_logging():
        try:
            context.set_solver_count(world_size)
            context.set_shard_test(True)
            context.set_multiprocess(True)
            context.set_solver_rank(rank)
            if device is not None:
                context.set_device(device)
                context.set_mode_gpu()
            comm_kind = comm_kind or (NcclComm if device is not None else FakeComm)
            uid = share_uid(comm_kind)
            p = prepare_solver_param(param, world_size, source, warn=rank == 0)
            from ..core.config import RunConfig
            cfg = (config or RunConfig.from_environment()).replace(world_size=world_size,
                                                                   rank=rank)
            solver = solver_class(p.type, source or "solver")(p, source=source, config=cfg)
            if rank == 0 and snapshot:
                log.info("Resuming from %s", snapshot)
                solver.restore(snapshot)
            elif rank == 0 and weights:
                solver.copy_weights(weights)
            channel.barrier(rank, world_size)
            manager = P2PManager(solver, [device], world_size=world_size, first_rank=rank,
                                 uid=uid, comm_kind=comm_kind, action_function=action_function,
                                 abort_channel=channel)
            return manager.run()
        except (ParallelError, KeyboardInterrupt):
            raise
        except CommAborted as e:          # another rank failed first
            raise ParallelError(str(e)) from None
        except BaseException as e:        # failed before training: tell the others
            text = str(e) if isinstance(e, MinicaffeError) else f"{type(e).__name__}: {e}"
            msg = f"{where}: {text}".replace("\n", " ")
            channel.signal(msg)
            raise ParallelError(msg) from e
        finally:
            context.set_solver_count(1)
            context.set_shard_test(False)
            context.set_multiprocess(False)
            if solver is not None:
                solver.close()


def file_uid(init_file, rank):
    """``share_uid`` for --init_file: rank 0 writes the id, the others read it."""
    return lambda kind: share_uid_by_file(init_file, rank, lambda: kind.new_uid(None))


def mpi_uid(world):
    return lambda kind: share_uid_by_mpi(world, lambda: kind.new_uid(None))


# -- the launcher ----------------------------------------------------------------------------------
def _describe_exit(code):
    if code < 0:
        try:
            return f"exited on signal {signal.Signals(-code).name}"
        except ValueError:  # pragma: no cover
            return f"exited on signal {-code}"
    return f"exited with status {code}"


def launch(argvs, init_file, grace_s=30.0, poll_s=0.1, env=None):
    """Run one child process per argv (rank r gets ``argvs[r]``) until all end.  SIGINT and
    SIGHUP are forwarded to every child (each runs in a session of its own, so a terminal's
    Ctrl-C reaches them once, through here).  When a child fails, the others learn it from
    the abort file (written here if the child could not); any still running ``grace_s``
    later are terminated.  Returns (exit status, the failure message or None)."""
    channel = FileAbortChannel(init_file)
    env = dict(os.environ if env is None else env)
    env[LAUNCHED_ENV] = "1"
    env.setdefault("PYTHONUNBUFFERED", "1")
    procs = []

    def forward(signum, frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)
    sigs = [signal.SIGINT] + ([signal.SIGHUP] if hasattr(signal, "SIGHUP") else [])
    previous = {}
    try:
        for s in sigs:
            previous[s] = signal.signal(s, forward)
        for argv in argvs:
            procs.append(subprocess.Popen(argv, env=env, start_new_session=True))
        failed_at = killed = None
        while True:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                break
            now = time.monotonic()
            if failed_at is None:
                for r, c in enumerate(codes):
                    if c not in (None, 0):
                        if channel.poll() is None:
                            channel.signal(f"rank {r}: {_describe_exit(c)}")
                        failed_at = now
                        break
                else:
                    if channel.poll() is not None:
                        failed_at = now
            elif now - failed_at > grace_s and killed is None:
                log.warning("ending the ranks still running %.0f s after the failure", grace_s)
                for p in procs:
                    if p.poll() is None:
                        p.terminate()
                killed = now
            elif killed is not None and now - killed > 5:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
            time.sleep(poll_s)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    message = channel.poll()
    codes = [p.returncode for p in procs]
    channel.cleanup(len(argvs))
    if all(c == 0 for c in codes):
        return 0, None
    return 1, message or f"rank {codes.index(next(c for c in codes if c))} " \
                         f"{_describe_exit(next(c for c in codes if c))}"


# -- the command line ------------------------------------------------------------------------------
MODES = ("thread", "process")


def check_multi_gpu(gpus):
    """The one-line errors for a multi-GPU request this machine cannot serve."""
    from ..core import backend
    from .comm import nccl_module, why_no_nccl
    dups = sorted({g for g in gpus if gpus.count(g) > 1})
    if dups:
        raise MinicaffeError(f"GPU {dups[0]} is listed more than once in --gpu "
                             f"{','.join(map(str, gpus))}")
    if not backend.cupy_available():
        raise MinicaffeError(f"--gpu {','.join(map(str, gpus))}: multi-GPU training needs "
                             f"CuPy: {backend.why_no_gpu()}")
    if nccl_module() is None:
        raise MinicaffeError(f"--gpu {','.join(map(str, gpus))}: multi-GPU training needs "
                             f"NCCL: {why_no_nccl()}")


def _child_argv(flags, rank, world_size, init_file, gpu):
    argv = [sys.executable, "-m", "minicaffe", "train", "--solver", flags.solver,
            "--gpu", str(gpu), "--rank", str(rank), "--world_size", str(world_size),
            "--init_file", init_file, "--sigint_effect", flags.sigint_effect,
            "--sighup_effect", flags.sighup_effect, "--level", str(flags.level)]
    for name in ("stage", "snapshot", "weights"):
        if getattr(flags, name):
            argv += [f"--{name}", getattr(flags, name)]
    if flags.debug_info:
        argv.append("--debug_info")
    for name in ("threads", "minloglevel", "data_workers", "precision", "offload",
                 "gpu_mem_limit"):
        if name in flags.given:
            argv += [f"--{name}", str(getattr(flags, name))]
    # the run's switches, as given (each rank reads the solver file again: a flag that
    # overrides its fields must reach every rank)
    for name in ("tf32", "cuda_graph", "gpu_decode", "share_data"):
        if name in flags.given:
            argv.append(f"--{name}" if getattr(flags, name) else f"--no{name}")
    if flags.quiet:
        argv.append("--quiet")
    if flags.log and rank == 0:
        argv += ["--log", flags.log]
    if getattr(flags, "tensorboard", "") and rank == 0:   # only the root solver writes
        argv += ["--tensorboard", flags.tensorboard]
    return argv


def train_parallel(flags, param, source, gpus, progress=None, describe=None):
    """``minicaffe train`` with several GPUs, a --rank, or under mpirun (cli.train).
    ``describe(gpu ids)`` logs the GPUs this process uses (after its rank is known)."""
    describe = describe or (lambda ids: None)
    from .comm import launched_by_mpirun, mpi_world
    from .parallel import train_threads
    from ..solvers.signal_handler import SignalHandler
    if flags.parallel not in MODES:
        raise MinicaffeError(f"--parallel must be thread or process (got '{flags.parallel}')")
    mpi_size = launched_by_mpirun()
    by_hand = flags.rank >= 0 or flags.world_size or flags.init_file
    if by_hand:
        if flags.rank < 0 or flags.world_size < 1 or not flags.init_file:
            raise MinicaffeError("one process per GPU by hand needs --rank, --world_size and "
                                 "--init_file together")
        if flags.rank >= flags.world_size:
            raise MinicaffeError(f"--rank {flags.rank} is not below --world_size "
                                 f"{flags.world_size}")
    if not gpus:
        raise MinicaffeError("the process mode needs GPUs (--gpu): each process drives one")
    check_multi_gpu(gpus)
    launched = config_env(LAUNCHED_ENV)
    if by_hand or mpi_size > 1:
        if by_hand:
            rank, size = flags.rank, flags.world_size
            local = int(os.environ.get("LOCAL_RANK", rank))
            channel, share = FileAbortChannel(flags.init_file), file_uid(flags.init_file, rank)
        else:
            world = mpi_world()
            if world is None:
                raise MinicaffeError(f"mpirun started {mpi_size} processes but mpi4py is "
                                     "missing (pip install \".[mpi]\")")
            world, rank, size, local = world
            channel, share = MpiAbortChannel(world), mpi_uid(world)
        if len(gpus) > 1 and local >= len(gpus):
            raise MinicaffeError(f"rank {rank} is local rank {local} of its machine but --gpu "
                                 f"lists {len(gpus)} GPUs")
        device = gpus[local] if len(gpus) > 1 else gpus[0]
        context.set_solver_rank(rank)      # from here on only rank 0 logs INFO
        log.info("Rank %d of %d", rank, size)
        describe([device])
        with SignalHandler(flags.sigint_effect, flags.sighup_effect) as h:
            try:
                train_rank(param, source, rank, size, device, share, channel,
                           snapshot=flags.snapshot or None, weights=flags.weights or None,
                           action_function=h.get_action,
                           config=getattr(flags, "run_config", None))
            except ParallelError:
                if launched:
                    raise SystemExit(1) from None   # the launcher prints the one error line
                raise
        return 0
    describe(gpus)
    if flags.parallel == "process":
        import tempfile
        d = tempfile.mkdtemp(prefix="minicaffe-init-")
        init_file = os.path.join(d, "nccl_id")
        argvs = [_child_argv(flags, r, len(gpus), init_file, g) for r, g in enumerate(gpus)]
        log.info("Starting %d processes, one per GPU", len(gpus))
        try:
            rc, message = launch(argvs, init_file)
        finally:
            try:
                os.rmdir(d)
            except OSError:
                pass
        if rc:
            raise ParallelError(message)
        return 0
    with SignalHandler(flags.sigint_effect, flags.sighup_effect) as h:
        train_threads(param, gpus, source, snapshot=flags.snapshot or None,
                      weights=flags.weights or None, action_function=h.get_action,
                      progress=progress, config=getattr(flags, "run_config", None))
    return 0
