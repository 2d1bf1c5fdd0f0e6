"""The executors of a training iteration: what the Solver's one loop (solvers/solver.py
``Solver.step``, Caffe's Solver::Step) calls, whatever the device.

- ``EagerExecutor``: the schedule (engine/schedule.py) run op by op, layer by layer, in
  the thread's mode: numpy on the CPU, CuPy on a GPU for solvers without the GPU step
  (and with ``debug_info``, which needs the host after every layer).  The loss is known
  after each iteration.
- ``GraphExecutor``: the SGD family on a GPU, through engine/step.GpuStep: the same ops
  eagerly or replayed as CUDA graphs, the update fused, the losses read back at log
  points only (``drain``), the host running ahead up to ``step.RING`` iterations.

The protocol, in the order the loop calls it each iteration::

    before_iteration()     the CPU clears the parameter diffs (before a test pass, as Caffe)
    full() / drain(cur)    the pending iterations' [(iteration, loss, gradient norm)]
    begin(display)         debug_info for this iteration / the rate into the GPU's ring
    forward_backward()     iter_size passes; the summed loss, or None (read at a drain)
    abandon()              a stop signal ended a wait for data: forget the iteration
    update()               the solver's rule (CPU) / the unfused update (GPU)
    end(iteration)         the iteration is queued (GPU)

``rate`` is the learning rate the executor took for this iteration when the Solver must
log it itself (the GPU), else None (the CPU rule logs its own)."""


class EagerExecutor:
    """Layer by layer, in this thread's mode (see the module docstring)."""
    rate = None

    def __init__(self, solver):
        from .schedule import schedule_for
        self.solver = solver
        self.net = solver.net
        self.schedule = schedule_for(self.net, solver.param.iter_size)

    def before_iteration(self):
        self.net.clear_param_diffs()

    def full(self):
        return False

    def drain(self, current=None):
        return []

    def begin(self, display):
        p, net = self.solver.param, self.net
        net.debug_info = display and (p.debug_info or net.net_param.debug_info)

    def forward_backward(self):
        from .schedule import run_eager
        loss = 0.0
        for pass_loss in run_eager(self.schedule, self.net):
            loss += pass_loss
        return loss

    def abandon(self):
        pass

    def update(self):
        self.solver.apply_update()

    def end(self, iteration):
        pass


class GraphExecutor:
    """The GPU step of the SGD family (engine/step.GpuStep), eager or replayed."""

    def __init__(self, solver, step):
        self.solver = solver
        self.step = step
        self.rate = None
        # with iter_size 1 and no on_gradients_ready callback, the update is part of the
        # forward-backward body (one graph launch per iteration)
        self.fused = solver.param.iter_size == 1 and not any(
            getattr(cb, "on_gradients_ready", None) for cb in solver.callbacks)

    def before_iteration(self):
        pass

    def full(self):
        return self.step.full()

    def drain(self, current=None):
        return self.step.drain(current)

    def begin(self, display):
        s = self.solver
        self.rate = s.get_learning_rate()
        self.step.begin(self.rate, s.fused_extra())

    def forward_backward(self):
        for k in range(self.solver.param.iter_size):
            self.step.forward_backward(first=k == 0, with_update=self.fused)
        return None

    def abandon(self):
        self.step.abandon()

    def update(self):
        if not self.fused:
            self.step.apply_update()

    def end(self, iteration):
        self.step.end(iteration)
