"""What every new Solver gets attached, registered by the packages above the solvers (no
Caffe counterpart): the watch package registers its TensorBoard writer here when it is
imported (``import minicaffe`` does), so that the solvers import nothing of it.

``register(fn)``: ``fn(solver)`` runs near the end of every Solver's set-up (after its
nets are built, before its state is allocated); ``attach(solver)`` (the Solver's call)
runs them in the order they were registered."""
_FACTORIES = []


def register(fn):
    """Run ``fn(solver)`` for every Solver built from now on (once however often
    registered); returns ``fn``."""
    if fn not in _FACTORIES:
        _FACTORIES.append(fn)
    return fn


def attach(solver):
    for fn in list(_FACTORIES):
        fn(solver)
