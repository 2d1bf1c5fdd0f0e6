"""The Net: a prototxt becomes a graph of layers (Caffe's net.cpp).

    net.py         Net: filtering by phase/state, split insertion, fusion, parameter
                   sharing, forward/backward, the hooks the engine and multigpu/ use
    upgrade.py     NetParameter/SolverParameter upgrades (Caffe's upgrade_proto.cpp)
    upgrade_v0.py  the V0 (padding-layer) net upgrade

The Net stands on the layers (``layers/``, with their registry and base class) and knows
nothing of the engine, the solvers or ``gpu/`` (docs/architecture.md).
"""
