"""The executor of a training iteration: what the Solver's one loop (solvers/solver.py
``Solver.step``, Caffe's Solver::Step) calls, whatever the device.  One class,
``Executor``, and one walker of the schedule's ops, ``run_ops``.

``run_ops(schedule, net, ring=None, first=0)`` executes the forward and backward ops of a
schedule (engine/schedule.py) in order, layer by layer through the Net's hooks
(``Net.forward_layer``/``backward_layer``), one pass of iter_size at a time
(``Net.begin_pass``/``end_pass``).  Without ``ring`` each forward's weighted loss is read
on the host and the loss of each pass returned; with ``ring = (address, counter, size)``
each loss is added on the device into a mapped ring and nothing is read back (the ops of
layers before ``first``, the data prologue run outside any graph, are skipped).  The loss
and update ops are the executor's, the copy and all-reduce ops the hooks' (the
offloader, P2PSync) from the same plans the passes print.

``Executor(solver, step=None, replicas=None)`` runs one solver's iterations in one of
four modes (``mode``):

- ``eager``: ``run_ops`` in this thread's mode: numpy on the CPU, CuPy on a GPU for
  solvers without the GPU step (and with ``debug_info``, which needs the host after every
  layer).  The loss is known after each iteration; the update is the solver's rule.
- ``device``: the SGD family on a GPU (``step``: engine/step.GpuStep, which holds the
  device's side: the memory plan, the rings, the fused update, the offloader): the
  prologue ops through ``run_ops`` eagerly, then the body's ops through ``run_ops`` with
  the losses into the step's ring, the update fused into the same body; the losses read
  back at log points only (``drain``), the host running ahead up to ``step.RING``
  iterations.
- ``replayed``: the same as ``device``, the body's ``run_ops`` captured once as a CUDA
  graph (the same op list) and replayed: the same kernels in the same order, the same
  bits.
- ``replicas``: CPU, the batch split across worker processes (``replicas``: an
  engine/replicas.ReplicaPool, ``RunConfig.cpu_replicas``): each pass, this process runs
  the data layers, the workers forward and backward on their slices, and their gradients
  are added into this net's diffs; the loss is known after each iteration, the update is
  the solver's rule, here, on the weights the workers read in place.

The protocol, in the order the loop calls it each iteration::

    before_iteration()     eager: clear the parameter diffs (before a test pass, as Caffe)
    full() / drain(cur)    the pending iterations' [(iteration, loss, gradient norm)]
    begin(display)         debug_info for this iteration / the rate into the GPU's ring
    forward_backward()     iter_size passes; the summed loss, or None (read at a drain)
    abandon()              a stop signal ended a wait for data: forget the iteration
    update()               the solver's rule (eager) / the unfused update (device)
    end(iteration)         the iteration is queued (device)

``rate`` is the learning rate the executor took for this iteration when the Solver must
log it itself (device modes), else None (the rule logs its own)."""
import math

from .schedule import schedule_for


def run_ops(schedule, net, ring=None, first=0):
    """Execute the forward and backward ops of ``schedule`` on ``net`` (see the module
    docstring); the loss of each pass (host mode), or [] (``ring``: the device's)."""
    losses = []
    fused = None
    in_backward = False
    for op in schedule.ops:
        if op.kind in ("prologue", "forward"):
            if fused is None or in_backward:
                if in_backward and ring is None:
                    net.end_pass()
                fused, in_backward = net.begin_pass(), False
                losses.append(0.0)
            for i in op.layers:
                if ring is None:
                    losses[-1] += net.forward_layer(i, fused)
                elif i >= first:
                    net.forward_layer_device(i, fused, *ring)
        elif op.kind == "backward":
            in_backward = True
            for i in reversed(op.layers):
                net.backward_layer(i)
    if in_backward and ring is None:
        net.end_pass()         # debug_info's norms: host mode only
    return [] if ring is not None else losses


class Executor:
    """The iterations of ``solver``: eagerly, or through GPU step ``step`` (device or
    replayed; see the module docstring)."""

    def __init__(self, solver, step=None, replicas=None):
        self.solver = solver
        self.net = solver.net
        self.step = step
        self.replicas = replicas
        self.rate = None
        self._replica_rate = None   # the rate the replicas' workers update with
        if step is None:
            self.schedule = schedule_for(self.net, solver.param.iter_size)
            self.fused = False
        else:
            self.schedule = step.schedule     # one pass: forward_backward loops iter_size
            # with iter_size 1 and no on_gradients_ready callback, the update is part of
            # the forward-backward body (one graph launch per iteration)
            self.fused = solver.param.iter_size == 1 and not any(
                getattr(cb, "on_gradients_ready", None) for cb in solver.callbacks)

    @property
    def mode(self):
        """``eager``, ``replicas``, ``device`` or ``replayed`` (the GPU step's graphs on)."""
        if self.step is None:
            return "eager" if self.replicas is None else "replicas"
        return "replayed" if self.step.graphs_on else "device"

    def before_iteration(self):
        if self.step is None and (self.replicas is None or self.replicas.update_op is None):
            self.net.clear_param_diffs()     # (the replicas' first sum overwrites them)

    def full(self):
        return self.step is not None and self.step.full()

    def drain(self, current=None):
        return [] if self.step is None else self.step.drain(current)

    def begin(self, display):
        s = self.solver
        if self.step is None:
            p = s.param
            self.net.debug_info = display and (p.debug_info or self.net.net_param.debug_info)
            return
        self.rate = s.get_learning_rate()
        self.step.begin(self.rate, s.fused_extra())

    def forward_backward(self):
        if self.replicas is not None:
            return self._replicas_forward_backward()
        if self.step is None:
            loss = 0.0
            for pass_loss in run_ops(self.schedule, self.net):
                loss += pass_loss
            return loss
        for k in range(self.solver.param.iter_size):
            self.step.forward_backward(first=k == 0, with_update=self.fused)
        return None

    def _replicas_forward_backward(self):
        """The passes of one iteration across the replicas; the solver's update goes with
        the last pass's sum into the workers (solvers/shares.py) unless a callback wants
        the summed gradients first (``on_gradients_ready``), which the update then
        follows in this process."""
        s, pool = self.solver, self.replicas
        self._replica_rate = None
        if pool.update_op is not None and not any(
                getattr(cb, "on_gradients_ready", None) for cb in s.callbacks):
            self._replica_rate = s.get_learning_rate()
        loss, n = 0.0, s.param.iter_size
        for k in range(n):
            update = None
            if self._replica_rate is not None and k == n - 1 and math.isfinite(loss):
                update = (self._replica_rate, s.iter)
            loss += pool.forward_backward(first=k == 0, update=update)
        return loss

    def abandon(self):
        if self.step is not None:
            self.step.abandon()

    def update(self):
        if self._replica_rate is not None:     # the workers update (or finish it now)
            s, pool = self.solver, self.replicas
            s.log_rate(self._replica_rate)
            if pool.update_pending:
                pool.finish_update(s.clip_scale(pool.sumsq()))
            self._replica_rate = None
        elif self.step is None:
            self.solver.apply_update()
        elif not self.fused:
            self.step.apply_update()

    def end(self, iteration):
        if self.step is not None:
            self.step.end(iteration)
