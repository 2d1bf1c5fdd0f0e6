"""The dependency rules of minicaffe's packages (docs/architecture.md), read from the source.

Every module under minicaffe/ is parsed with ``ast``; every import counts, the ones inside
functions included (a lazy import is still a dependency).  A forbidden arrow fails with the
module, the line and the rule it breaks:

- the packages are layered, bottom to top: core (and proto) <- gpu <- kernels, layers,
  data <- network <- engine <- solvers <- multigpu <- the front (cli, bench, compat, tools,
  watch, ...); a module imports nothing of a level above its own (``ALLOWED_UPWARD``,
  the arrows excepted, is empty);
- cupy/cupyx, and ctypes (the way CUDA libraries are called), only in
  ``minicaffe/core/backend.py`` and ``minicaffe/gpu/`` (ctypes elsewhere only where it
  calls no CUDA library: listed below);
- ``gpu/`` holds bindings: it imports nothing of layers, solvers, engine, network,
  multigpu;
- layers know nothing of the engine (offload included), other GPUs or the Net;
- the Net does not import ``gpu/``, nor the engine above it;
- backend and context (the core) do not import ``gpu/``.

The old flat module paths (``minicaffe.context``, ``minicaffe.net``...) are the same module
objects as the new ones (``minicaffe.MOVED``): tested at the end.
"""
import ast
import importlib
import pathlib
import subprocess
import sys

import pytest

import minicaffe

PKG = pathlib.Path(__file__).resolve().parents[1] / "minicaffe"

# ctypes outside backend/gpu that calls no CUDA library: module -> what it calls
CTYPES_WITHOUT_CUDA = {
    "minicaffe.bench": "libc's malloc_trim and OpenBLAS's thread count",
}

M = "minicaffe."
# bottom to top; a module outside every listed package is the front (level len(LEVELS))
LEVELS = (
    ("core", (M + "core", M + "proto")),
    ("gpu", (M + "gpu",)),
    ("kernels/layers/data", (M + "kernels", M + "layers", M + "data")),
    ("network", (M + "network",)),
    ("engine", (M + "engine",)),
    ("solvers", (M + "solvers",)),
    ("multigpu", (M + "multigpu",)),
)
# the arrows that go up a level, each with its reason: (importer, imported) -> why
# Arrows that go up a level anyway, each with its reason: none.  The last three
# (core/config -> gpu/options, engine/step -> solvers/fused, solvers/solver ->
# watch/tensorboard) went in issue 18's last round: the tf32 default is kept by the core,
# the solver hands its fused update op to the engine, and the watch package registers
# its TensorBoard observer with core/observers.py.
ALLOWED_UPWARD = {}


def level(mod):
    """(index, name) of the level of module ``mod``."""
    for i, (name, packages) in enumerate(LEVELS):
        if _under(mod, *packages):
            return i, name
    return len(LEVELS), "front"


def _module_name(path):
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules():
    return {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


MODULES = _modules()


def _imports(name, path):
    """[(line, imported module)] of every import statement in the module, anywhere in it."""
    is_pkg = path.name == "__init__.py"
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module
            out.append((node.lineno, mod))
            for a in node.names:        # `from . import gpu` imports the module minicaffe.gpu
                if f"{mod}.{a.name}" in MODULES:
                    out.append((node.lineno, f"{mod}.{a.name}"))
    return out


def _under(mod, *packages):
    return any(mod == p or mod.startswith(p + ".") for p in packages)


def _rules(name):
    """[(forbidden module prefixes, why)] for module ``name``."""
    m = M
    rules = []
    if not (name == m + "core.backend" or _under(name, m + "gpu")):
        rules.append((("cupy", "cupyx"), "CuPy is imported only by core/backend.py and gpu/"))
        if name not in CTYPES_WITHOUT_CUDA:
            rules.append((("ctypes",), "CUDA libraries are called (ctypes) only in "
                                       "core/backend.py and gpu/"))
    i, lname = level(name)
    above = tuple(p for _, packages in LEVELS[i + 1:] for p in packages)
    if i < len(LEVELS):
        # the front: every module of minicaffe outside the listed packages
        front = tuple(m + p.stem for p in sorted(PKG.iterdir())
                      if (p.suffix == ".py" or (p / "__init__.py").exists())
                      and not any(_under(m + p.stem, *pk) for _, pk in LEVELS))
        rules.append((above + front, f"{lname} imports nothing of a level above it "
                                     f"(docs/architecture.md)"))
    if _under(name, m + "gpu"):
        rules.append(((m + "layers", m + "solvers", m + "engine", m + "network",
                       m + "multigpu"), "gpu/ holds bindings and imports nothing above them"))
    if _under(name, m + "layers"):
        rules.append(((m + "engine", m + "multigpu", m + "network"),
                      "layers know nothing of the engine, offload, other GPUs or the Net"))
    if name == m + "network.net":
        rules.append(((m + "gpu",), "the Net does not import gpu/"))
        rules.append(((m + "engine", m + "solvers", m + "multigpu"),
                      "the Net knows nothing of the engine above it (offload, engine, "
                      "solvers, multigpu)"))
    if name in (m + "core.backend", m + "core.context"):
        rules.append(((m + "gpu",), "the core (backend, context) does not import gpu/"))
    return rules


def _allowed(name, imports_on_line, mod):
    """True when ``mod`` is an ALLOWED_UPWARD arrow of ``name`` (or the package of one
    imported on the same line, as ``from ..gpu import options`` imports minicaffe.gpu)."""
    return any((name, other) in ALLOWED_UPWARD and (other == mod or other.startswith(mod + "."))
               for other in imports_on_line)


def _violations():
    out = []
    for name, path in MODULES.items():
        rules = _rules(name)
        imports = _imports(name, path)
        for line, mod in imports:
            if _allowed(name, [o for l, o in imports if l == line], mod):
                continue
            for forbidden, why in rules:
                if _under(mod, *forbidden):
                    out.append(f"{path.relative_to(PKG.parent)}:{line}: imports {mod}: {why}")
    return out


def test_the_package_has_no_forbidden_import():
    bad = _violations()
    assert not bad, "\n".join(bad)


def test_the_checker_sees_imports_inside_functions(tmp_path):
    """The reader counts a lazy import, a relative one and `from . import module`."""
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from ..gpu import cudnn\n    import cupy\n"
                   "from . import backend\n")
    got = [m for _, m in _imports("minicaffe.layers.m", src)]
    assert "minicaffe.gpu" in got and "minicaffe.gpu.cudnn" in got and "cupy" in got
    assert "minicaffe.layers.backend" in got or "minicaffe.layers" in got


@pytest.mark.parametrize("name,imported,allowed", [
    ("minicaffe.network.net", "minicaffe.gpu.cudnn", False),
    ("minicaffe.network.net", "minicaffe.engine.offload", False),
    ("minicaffe.network.net", "minicaffe.engine.schedule", False),
    ("minicaffe.gpu.cublas", "minicaffe.engine.plan", False),
    ("minicaffe.layers.vision", "minicaffe.engine.offload", False),
    ("minicaffe.core.context", "minicaffe.gpu.pool", False),
    ("minicaffe.multigpu.parallel", "cupyx", False),
    ("minicaffe.multigpu.comm", "ctypes", False),
    ("minicaffe.gpu.nccl", "ctypes", True),
    ("minicaffe.engine.step", "minicaffe.gpu.graph", True),
    ("minicaffe.layers.cudnn_layers", "minicaffe.gpu.cudnn", True),
    # the levels
    ("minicaffe.core.blob", "minicaffe.layers.layer", False),
    ("minicaffe.core.config", "minicaffe.compat.io", False),
    ("minicaffe.gpu.cudnn", "minicaffe.kernels.im2col", False),
    ("minicaffe.layers.common", "minicaffe.network.net", False),
    ("minicaffe.data.prefetch", "minicaffe.layers.layer", True),
    ("minicaffe.network.net", "minicaffe.layers.registry", True),
    ("minicaffe.engine.schedule", "minicaffe.solvers.solver", False),
    ("minicaffe.solvers.solver", "minicaffe.engine.executor", True),
    ("minicaffe.solvers.solver", "minicaffe.multigpu.parallel", False),
    ("minicaffe.solvers.solver", "minicaffe.cli", False),
    ("minicaffe.multigpu.parallel", "minicaffe.solvers.solver", True),
    ("minicaffe.multigpu.comm", "minicaffe.compat.pycaffe", False),
    ("minicaffe.cli", "minicaffe.multigpu.parallel", True),
    ("minicaffe.compat.pycaffe", "minicaffe.multigpu.comm", True),
    # the three arrows that went up until issue 18's last round
    ("minicaffe.core.config", "minicaffe.gpu.options", False),
    ("minicaffe.engine.step", "minicaffe.solvers.fused", False),
    ("minicaffe.solvers.solver", "minicaffe.watch.tensorboard", False),
])
def test_the_rules_forbid_what_they_say(name, imported, allowed):
    hit = any(_under(imported, *f) for f, _ in _rules(name))
    assert hit != allowed


def test_each_allowed_upward_arrow_is_up_and_still_there():
    """An exception that no longer goes up, or that the code no longer has, is removed
    (none is listed now: every arrow goes down)."""
    assert ALLOWED_UPWARD == {}
    for (name, imported), why in ALLOWED_UPWARD.items():
        assert level(imported)[0] > level(name)[0], (name, imported)
        assert imported in [m for _, m in _imports(name, MODULES[name])], (name, imported)


def test_a_forbidden_arrow_in_a_file_fails(tmp_path):
    """The whole check, on a module of the core importing the Net lazily."""
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from ..network.net import Net\n")
    name = "minicaffe.core.m"
    hits = [(line, mod) for line, mod in _imports(name, src)
            if any(_under(mod, *f) for f, _ in _rules(name))]
    assert hits == [(2, "minicaffe.network.net")]


# -- the old flat module paths ---------------------------------------------------------------
@pytest.mark.parametrize("old,new", sorted(minicaffe.MOVED.items()))
def test_an_old_module_path_is_the_new_module(old, new):
    """``minicaffe.context`` is ``minicaffe.core.context``: one module, one state."""
    module = importlib.import_module(new)
    assert importlib.import_module(old) is module
    assert sys.modules[old] is module and module.__name__ == new
    assert module.__spec__.name == new          # the alias leaves the module's own spec
    assert getattr(minicaffe, old.rsplit(".", 1)[1]) is module
    assert not (PKG.parent / (old.replace(".", "/") + ".py")).exists()   # no second file


def test_old_paths_imported_first_and_python_m_of_an_old_path(tmp_path):
    """In a fresh process: the old path imported before the new one is the same module,
    its state is shared, and ``python -m minicaffe.draw`` runs the new module's main."""
    code = ("import minicaffe.context as old, minicaffe.synced_memory as sm\n"
            "import minicaffe.core.context as new, minicaffe.core.synced_memory as sm2\n"
            "assert old is new and sm is sm2\n"
            "old.set_solver_count(3)\n"
            "assert new.solver_count() == 3\n"
            "from minicaffe.net import Net\n"
            "import minicaffe.network.net as n\n"
            "assert Net is n.Net\n")
    root = str(PKG.parent)
    env = {**__import__("os").environ, "PYTHONPATH": root}
    subprocess.run([sys.executable, "-W", "error", "-c", code], check=True, cwd=root,
                   env=env, timeout=120)
    out = subprocess.run([sys.executable, "-m", "minicaffe.draw", "--help"], cwd=root,
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "input_net_proto_file" in out.stdout, out.stderr


# -- SyncedMemory's state changes only through its own methods ---------------------------------
# its private fields; ``head`` and ``planned`` may be read anywhere but set only by it
SYNCED_PRIVATE = ("_cpu", "_gpu", "_own_cpu", "_own_gpu", "_pinned")
SYNCED_SET_ONLY_BY_ITSELF = ("head", "planned")


def _private_state_uses(path):
    """[(line, what)]: a SyncedMemory private field reached on an object other than
    ``self`` (another class's own ``self._gpu`` is its business), or ``head``/``planned``
    assigned on an object other than ``self``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Attribute):
            continue
        owner_is_self = isinstance(node.value, ast.Name) and node.value.id == "self"
        if node.attr in SYNCED_PRIVATE and not owner_is_self:
            out.append((node.lineno, f"reads or writes .{node.attr}"))
        elif node.attr in SYNCED_SET_ONLY_BY_ITSELF and isinstance(node.ctx, ast.Store) \
                and not owner_is_self:
            out.append((node.lineno, f"sets .{node.attr}"))
    return out


def test_nothing_else_touches_synced_memorys_private_state():
    """The memory plan, the offloader and the GPU step move a SyncedMemory through its
    public transitions (bind_device, unbind_device, park, drop_host, device_written)."""
    bad = []
    for name, path in MODULES.items():
        if name == "minicaffe.core.synced_memory":
            continue
        bad += [f"{path.relative_to(PKG.parent)}:{line}: {what} of another object "
                f"(a SyncedMemory's state changes through its own methods)"
                for line, what in _private_state_uses(path)]
    assert not bad, "\n".join(bad)


def test_the_private_state_checker_sees_what_it_says(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("def f(m, self):\n    m._gpu = None\n    x = m._cpu\n    m.head = 1\n"
                   "    y = m.head\n    self._gpu = 2\n    self.head = 3\n")
    assert [l for l, _ in _private_state_uses(src)] == [2, 3, 4]


# -- the raw cupy module stays in backend.py and gpu/ -----------------------------------------
def _raw_cupy_uses(name, path):
    """[(line, what)]: ``backend.cp`` (the cupy module itself), ``cp.cuda`` (its runtime),
    or ``cp`` imported from backend."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id == "backend" and node.attr == "cp":
                out.append((node.lineno, "backend.cp"))
            elif node.value.id == "cp" and node.attr == "cuda":
                out.append((node.lineno, "cp.cuda"))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").endswith("backend") \
                and any(a.name == "cp" for a in node.names):
            out.append((node.lineno, "imports cp from backend"))
    return out


def test_the_raw_cupy_module_is_used_only_in_backend_and_gpu():
    """Outside backend.py and gpu/, the device is reached through backend's named calls
    (gpu_module, new_stream, new_event, elapsed_ms, device_properties...)."""
    bad = []
    for name, path in MODULES.items():
        if name == "minicaffe.core.backend" or _under(name, "minicaffe.gpu"):
            continue
        bad += [f"{path.relative_to(PKG.parent)}:{line}: {what} (use a named function of "
                f"backend.py or gpu/)" for line, what in _raw_cupy_uses(name, path)]
    assert not bad, "\n".join(bad)


def test_the_raw_cupy_checker_sees_what_it_says(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("from .backend import cp\nx = backend.cp\ny = cp.cuda.Event()\n"
                   "z = backend.gpu_module()\nw = cp.zeros(3)\n")
    assert [l for l, _ in _raw_cupy_uses("minicaffe.m", src)] == [1, 2, 3]


# -- no engine attribute written onto a layer from outside -------------------------------------
# What the Net, the engine, the solvers and the multi-GPU code may set on a layer: its run
# configuration (RunConfig, handed Net -> layer).  Everything else they tell a layer goes
# through a declaration the layer makes and they read (retain_inputs, cudnn_reads_top...)
# or a table of their own (Net.top_rewritten, GpuStep.input_places).
LAYER_ATTRIBUTES_SET_OUTSIDE = {"config"}


def _layer_attribute_writes(path):
    """[(line, attribute)]: an assignment to an attribute of something named ``layer``,
    ``l`` or an item of a ``.layers`` list."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for t in targets:
            for a in ast.walk(t):
                if isinstance(a, ast.Attribute) and isinstance(a.ctx, ast.Store):
                    owner = ast.unparse(a.value)
                    if owner in ("layer", "l") or ".layers[" in owner or \
                            owner.startswith("layers["):
                        out.append((node.lineno, a.attr))
    return out


def test_nothing_above_the_layers_writes_an_engine_attribute_onto_a_layer():
    bad = []
    for name, path in MODULES.items():
        if not _under(name, M + "network", M + "engine", M + "solvers", M + "multigpu"):
            continue
        bad += [f"{path.relative_to(PKG.parent)}:{line}: sets layer.{attr} (declare it on "
                f"the layer and read it, or keep it in a table of your own)"
                for line, attr in _layer_attribute_writes(path)
                if attr not in LAYER_ATTRIBUTES_SET_OUTSIDE]
    assert not bad, "\n".join(bad)


def test_the_layer_attribute_checker_sees_what_it_says(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("def f(net, layer, i):\n    layer.top_rewritten = True\n"
                   "    net.layers[i].fixed_tops = True\n    layer.config = 1\n"
                   "    x = layer.top_rewritten\n    self.layers = []\n")
    assert _layer_attribute_writes(src) == [(2, "top_rewritten"), (3, "fixed_tops"),
                                            (4, "config")]
