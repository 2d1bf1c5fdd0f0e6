"""Solvers: Caffe's solver.cpp and sgd_solvers (SGD, Nesterov, AdaGrad, RMSProp,
AdaDelta, Adam), learning-rate policies and snapshots.

``get_solver(path_or_param)`` builds the solver its ``type`` names (the deprecated
``solver_type`` enum is upgraded); ``solver.solve()`` trains to max_iter.
"""
from .solver import Solver, SolverAction, NonFiniteLossError
from .sgd_solvers import (SGDSolver, NesterovSolver, AdaGradSolver, RMSPropSolver,
                          AdaDeltaSolver, AdamSolver, get_solver, register_solver,
                          solver_class, solver_type_list)
from .lr_policy import learning_rate, POLICIES as LR_POLICIES
from .param import read_solver_param

__all__ = ["Solver", "SGDSolver", "NesterovSolver", "AdaGradSolver", "RMSPropSolver",
           "AdaDeltaSolver", "AdamSolver", "get_solver", "register_solver", "solver_class",
           "solver_type_list", "learning_rate", "LR_POLICIES", "read_solver_param",
           "SolverAction", "NonFiniteLossError"]
