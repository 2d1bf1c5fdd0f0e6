"""The dependency rules of minicaffe's packages (docs/architecture.md), read from the source.

Every module under minicaffe/ is parsed with ``ast``; every import counts, the ones inside
functions included (a lazy import is still a dependency).  A forbidden arrow fails with the
module, the line and the rule it breaks:

- cupy/cupyx, and ctypes (the way CUDA libraries are called), only in ``minicaffe/backend.py``
  and ``minicaffe/gpu/`` (ctypes elsewhere only where it calls no CUDA library: listed below);
- ``gpu/`` holds bindings: it imports nothing of layers, solvers, engine, offload, net,
  parallel;
- layers know nothing of the engine, other GPUs or offload;
- the Net does not import ``gpu/``, nor the engine above it (offload, engine, solvers,
  parallel);
- backend and context (the core) do not import ``gpu/``.
"""
import ast
import pathlib

import pytest

PKG = pathlib.Path(__file__).resolve().parents[1] / "minicaffe"

# ctypes outside backend/gpu that calls no CUDA library: module -> what it calls
CTYPES_WITHOUT_CUDA = {
    "minicaffe.bench": "libc's malloc_trim and OpenBLAS's thread count",
}


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
    m = "minicaffe."
    rules = []
    if not (name == m + "backend" or _under(name, m + "gpu")):
        rules.append((("cupy", "cupyx"), "CuPy is imported only by backend.py and gpu/"))
        if name not in CTYPES_WITHOUT_CUDA:
            rules.append((("ctypes",), "CUDA libraries are called (ctypes) only in backend.py "
                                       "and gpu/"))
    if _under(name, m + "gpu"):
        rules.append(((m + "layers", m + "solvers", m + "engine", m + "offload", m + "net",
                       m + "parallel"), "gpu/ holds bindings and imports nothing above them"))
    if _under(name, m + "layers"):
        rules.append(((m + "engine", m + "parallel", m + "offload"),
                      "layers know nothing of the engine, other GPUs or offload"))
    if name == m + "net":
        rules.append(((m + "gpu",), "the Net does not import gpu/"))
        rules.append(((m + "offload", m + "engine", m + "solvers", m + "parallel"),
                      "the Net knows nothing of the engine above it (offload, engine, "
                      "solvers, parallel)"))
    if name in (m + "backend", m + "context"):
        rules.append(((m + "gpu",), "the core (backend, context) does not import gpu/"))
    return rules


def _violations():
    out = []
    for name, path in MODULES.items():
        rules = _rules(name)
        for line, mod in _imports(name, path):
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
    ("minicaffe.net", "minicaffe.gpu.cudnn", False),
    ("minicaffe.net", "minicaffe.offload", False),
    ("minicaffe.net", "minicaffe.engine.schedule", False),
    ("minicaffe.gpu.plan", "minicaffe.layers.cudnn_layers", False),
    ("minicaffe.layers.vision", "minicaffe.offload", False),
    ("minicaffe.context", "minicaffe.gpu.pool", False),
    ("minicaffe.parallel", "cupyx", False),
    ("minicaffe.comm", "ctypes", False),
    ("minicaffe.gpu.nccl", "ctypes", True),
    ("minicaffe.engine.step", "minicaffe.gpu.graph", True),
    ("minicaffe.layers.cudnn_layers", "minicaffe.gpu.cudnn", True),
])
def test_the_rules_forbid_what_they_say(name, imported, allowed):
    hit = any(_under(imported, *f) for f, _ in _rules(name))
    assert hit != allowed


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
        if name == "minicaffe.synced_memory":
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
        if name == "minicaffe.backend" or _under(name, "minicaffe.gpu"):
            continue
        bad += [f"{path.relative_to(PKG.parent)}:{line}: {what} (use a named function of "
                f"backend.py or gpu/)" for line, what in _raw_cupy_uses(name, path)]
    assert not bad, "\n".join(bad)


def test_the_raw_cupy_checker_sees_what_it_says(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("from .backend import cp\nx = backend.cp\ny = cp.cuda.Event()\n"
                   "z = backend.gpu_module()\nw = cp.zeros(3)\n")
    assert [l for l, _ in _raw_cupy_uses("minicaffe.m", src)] == [1, 2, 3]
