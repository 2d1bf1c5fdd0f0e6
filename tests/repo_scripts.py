"""For the tests: a script of the repository (benchmarks/, tools/, examples/) imported as a
module by its path, without running its ``__main__`` part."""
import importlib.util
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[1]


def load_script(relpath, name=None):
    path = REPO / relpath
    spec = importlib.util.spec_from_file_location(name or "_" + path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
