"""Shared plumbing of the data tools (``python -m minicaffe.tools.X``): gflags-style
boolean flags (``--gray``, ``--gray=true``, ``--gray=false``), glog logging to stderr,
and one-line errors with exit status 1."""
import argparse
import sys

from ..core import log
from ..core.errors import MinicaffeError


def flag_bool(text):
    t = str(text).lower()
    if t in ("1", "true", "yes", "y", "t"):
        return True
    if t in ("0", "false", "no", "n", "f"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got '{text}'")


def add_bool(ap, name, help):
    """A gflags boolean: --name, --noname, --name=true|false (see gflags_argv)."""
    ap.add_argument("--" + name, dest=name, action="store_true", default=False, help=help)
    ap.add_argument("--no" + name, dest=name, action="store_false", help=argparse.SUPPRESS)
    ap.__dict__.setdefault("_gflags_bools", set()).add(name)


def gflags_argv(ap, argv):
    """Rewrite gflags spellings argparse does not know: -flag (one dash) and
    --boolflag=true/false."""
    bools = getattr(ap, "_gflags_bools", set())
    out = []
    for tok in argv:
        if tok.startswith("-") and not tok.startswith("--") and len(tok) > 2 and \
                not tok[1].isdigit():
            tok = "-" + tok
        if tok.startswith("--") and "=" in tok:
            name, value = tok[2:].split("=", 1)
            if name in bools:
                try:
                    tok = "--" + name if flag_bool(value) else "--no" + name
                except argparse.ArgumentTypeError as e:
                    ap.error(f"--{name}: {e}")
        out.append(tok)
    return out


def backend_arg(ap):
    ap.add_argument("--backend", default="lmdb", choices=("lmdb", "leveldb"),
                    help="the database type (default %(default)s)")


def run(prog, body, argv):
    """Run ``body(argv)`` with logging on; a MinicaffeError or OSError is one line on
    stderr and exit status 1."""
    log.init_log()
    try:
        body(argv)
    except MinicaffeError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        name = f"{e.filename}: " if getattr(e, "filename", None) else ""
        print(f"{prog}: error: {name}{e.strerror or e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    return 0
