"""Learning-rate policies: Caffe's ``SGDSolver::GetLearningRate``.

``iter`` is the number of updates done so far.  The rate is computed in float32,
as Caffe computes it with ``Dtype = float``, so the logged value matches
Caffe's digits (``Iteration 100, lr = 0.00992565`` for lenet_solver's inv).

- fixed:     base_lr
- step:      base_lr * gamma ^ floor(iter / stepsize)
- exp:       base_lr * gamma ^ iter
- inv:       base_lr * (1 + gamma * iter) ^ (-power)
- multistep: base_lr * gamma ^ (number of stepvalues reached)
- poly:      base_lr * (1 - iter / max_iter) ^ power
- sigmoid:   base_lr * 1 / (1 + exp(-gamma * (iter - stepsize)))
"""
import numpy as np

from ..core import log
from ..core.errors import ConfigError

POLICIES = ("fixed", "step", "exp", "inv", "multistep", "poly", "sigmoid")

_f = np.float32


def check_policy(param, source="solver"):
    """Raise a one-line ConfigError unless ``param.lr_policy`` can be evaluated."""
    policy = param.lr_policy
    if not policy:
        raise ConfigError(f"{source}: lr_policy is not set (one of: {', '.join(POLICIES)})")
    if policy not in POLICIES:
        raise ConfigError(f"{source}: unknown lr_policy '{policy}' "
                          f"(known: {', '.join(POLICIES)})")
    if policy in ("step", "sigmoid") and param.stepsize <= 0:
        raise ConfigError(f"{source}: lr_policy '{policy}' needs stepsize > 0")
    if policy in ("step", "exp", "inv", "multistep", "sigmoid") and param.gamma < 0:
        raise ConfigError(f"{source}: lr_policy '{policy}' needs gamma >= 0")
    if policy == "poly" and param.max_iter <= 0:
        raise ConfigError(f"{source}: lr_policy 'poly' needs max_iter > 0")


def learning_rate(param, iter_, current_step=0, log_steps=True):
    """(rate, current_step) for iteration ``iter_``; ``current_step`` is the solver's
    step counter (step and multistep policies advance it, as Caffe does)."""
    policy = param.lr_policy
    base_lr = _f(param.base_lr)
    gamma = _f(param.gamma)
    with np.errstate(over="ignore", under="ignore", divide="ignore", invalid="ignore"):
        if policy == "fixed":
            rate = base_lr
        elif policy == "step":
            current_step = iter_ // param.stepsize
            rate = base_lr * np.power(gamma, _f(current_step))
        elif policy == "exp":
            rate = base_lr * np.power(gamma, _f(iter_))
        elif policy == "inv":
            rate = base_lr * np.power(_f(1) + gamma * _f(iter_), -_f(param.power))
        elif policy == "multistep":
            if current_step < len(param.stepvalue) and iter_ >= param.stepvalue[current_step]:
                current_step += 1
                if log_steps:
                    log.info("MultiStep Status: Iteration %d, step = %d", iter_, current_step)
            rate = base_lr * np.power(gamma, _f(current_step))
        elif policy == "poly":
            rate = base_lr * np.power(_f(1) - _f(iter_) / _f(param.max_iter), _f(param.power))
        elif policy == "sigmoid":
            rate = base_lr * (_f(1) / (_f(1) + np.exp(-gamma * (_f(iter_) - _f(param.stepsize)))))
        else:
            check_policy(param)
            raise AssertionError("unreachable")
    return _f(rate), current_step
