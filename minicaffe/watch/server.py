"""The dashboard server: a read-only HTTP server in a daemon thread.

No Caffe counterpart (NVIDIA DIGITS served the same per job).  ``serve(run, port=0,
host="127.0.0.1")`` starts a ``ThreadingHTTPServer`` off the training thread and
returns a ``Dashboard`` (``url``, ``close()``; a context manager).  ``run`` is a Solver
(a ``Recorder`` is attached to it: the page shows what the solver already computed at
display, test and snapshot time), a ``RunRecord``, or the path of a training log or a
TensorBoard event file/folder (read again whenever the file changes, so a log still
being written updates too).

Routes (GET/HEAD only; anything else is refused): ``/`` the page (page.py), ``/api/run``
the record as JSON (``?since=VERSION``: only ``{"version", "unchanged"}`` when nothing
changed since then), ``/net.svg`` the net drawn by ``minicaffe draw`` (Graphviz's ``dot``;
404 with the reason otherwise).  It binds 127.0.0.1 unless a host is given.  Bound to
any other host, or with ``require_token=True``, every request must carry the run's
token (``?token=...``, generated unless given; the URL holding it is printed once):
a request without it, or with a wrong one, gets 403.
"""
import hmac
import json
import os
import secrets
import shutil
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

from ..core.errors import MinicaffeError
from .page import PAGE
from .record import Recorder, RunRecord

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
_CSP = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
        "img-src 'self'; connect-src 'self'")


def parse_address(text, flag="--dashboard"):
    """(host, port) from '[HOST:]PORT' ('8080', 'localhost:8080', '0.0.0.0:8080',
    '[::1]:8080'); the host is 127.0.0.1 unless given."""
    text = str(text).strip()
    host, sep, port = text.rpartition(":")
    host = host.strip("[]") if sep else "127.0.0.1"
    try:
        port = int(port)
    except ValueError:
        raise MinicaffeError(f"{flag}: '{text}' is not [HOST:]PORT (e.g. 8080 or "
                             "0.0.0.0:8080)") from None
    if not 0 <= port <= 65535:
        raise MinicaffeError(f"{flag}: port {port} is not in 0-65535")
    return host or "127.0.0.1", port


def token_required(host):
    """A server bound to anything but the loopback interface needs a token."""
    return host not in LOCAL_HOSTS


class _FileRun:
    """A record read from a log or event file, read again when the file changes."""

    def __init__(self, path):
        self.path = os.fspath(path)
        self._key = None
        self._record = None
        self._lock = threading.Lock()
        self.to_dict()  # a bad file fails now, in the caller's thread

    def _stamp(self):
        from .tensorboard import event_files
        files = event_files(self.path) if _is_events(self.path) else [self.path]
        return tuple((f, os.path.getmtime(f), os.path.getsize(f)) for f in files)

    def to_dict(self):
        with self._lock:
            key = self._stamp()
            if key != self._key:
                self._record = read_run(self.path)
                self._key = key
            return self._record.to_dict()


def _is_events(path):
    return os.path.isdir(path) or "tfevents" in os.path.basename(path)


def read_run(path):
    """A RunRecord from a training log (Caffe's or minicaffe's) or TensorBoard events."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise MinicaffeError(f"{path}: no such file or folder")
    if _is_events(path):
        from .tensorboard import read_events
        return read_events(path)
    from .logparse import read_log
    return read_log(path)


def _net_svg(net_param):
    """(status, body) of the net's drawing as SVG."""
    if net_param is None:
        return 404, b"no drawing: this run was read from a file that does not hold its net"
    if shutil.which("dot") is None:
        return 404, (b"no drawing: the net is drawn by Graphviz's dot program "
                     b"(apt-get install graphviz), which this machine lacks")
    from ..compat.draw import get_dot, render
    try:
        return 200, render(get_dot(net_param, "LR"), "svg")
    except MinicaffeError as e:
        return 404, f"no drawing: {e}".encode()


class _Handler(BaseHTTPRequestHandler):
    server_version = "minicaffe-dashboard"
    dashboard = None  # set on a subclass per server

    def log_message(self, format, *args):  # no access log on the training terminal
        pass

    def _send(self, status, body, ctype="text/plain; charset=utf-8", head=False):
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Content-Security-Policy", _CSP)
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _get(self, head=False):
        d = self.dashboard
        url = urlsplit(self.path)
        if d.token is not None:
            given = parse_qs(url.query).get("token", [""])[0]
            if not hmac.compare_digest(given.encode(), d.token.encode()):
                why = b"wrong token" if given else b"this dashboard needs its token (?token=...)"
                return self._send(403, b"403 forbidden: " + why + b"\n", head=head)
        path = url.path
        if path in ("/", "/index.html"):
            return self._send(200, PAGE.encode(), "text/html; charset=utf-8", head)
        if path == "/api/run":
            try:
                run = d.run.to_dict()
            except (OSError, MinicaffeError, ValueError) as e:   # a log gone or garbled
                return self._send(500, f"cannot read the run: {e}\n".encode(), head=head)
            since = parse_qs(url.query).get("since", [""])[0]
            if since == str(run["version"]):      # nothing new since the last poll
                run = {"version": run["version"], "unchanged": True}
            body = json.dumps(run, allow_nan=False).encode()
            return self._send(200, body, "application/json", head)
        if path == "/net.svg":
            status, body = d.net_svg()
            return self._send(status, body, "image/svg+xml" if status == 200 else
                              "text/plain; charset=utf-8", head)
        return self._send(404, b"404 not found\n", head=head)

    def do_GET(self):
        try:
            self._get()
        except (BrokenPipeError, ConnectionResetError):
            pass

    def do_HEAD(self):
        self._get(head=True)

    def _refuse(self):
        self._send(405, b"405: the dashboard is read-only\n")

    do_POST = do_PUT = do_DELETE = do_PATCH = _refuse


class Dashboard:
    """A running dashboard server; ``url`` (with the token when one is needed), ``close()``."""

    def __init__(self, run, host="127.0.0.1", port=0, token=None, require_token=None,
                 net_param=None):
        self.run = run
        self.host = host
        self._net_param = net_param
        self._net = None
        self._net_lock = threading.Lock()
        if require_token is None:
            require_token = token_required(host)
        self.token = (token or secrets.token_urlsafe(16)) if require_token else None
        handler = type("Handler", (_Handler,), {"dashboard": self})
        try:
            self.server = ThreadingHTTPServer((host, port), handler)
        except OSError as e:
            raise MinicaffeError(f"--dashboard {host}:{port}: cannot listen there "
                                 f"({e.strerror or e})") from None
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        shown = f"[{host}]" if ":" in host else host
        self.url = f"http://{shown}:{self.port}/" + (f"?token={self.token}" if self.token else "")
        self._thread = threading.Thread(target=self.server.serve_forever, name="dashboard",
                                        kwargs={"poll_interval": 0.2}, daemon=True)
        self._thread.start()

    def net_svg(self):
        with self._net_lock:
            if self._net is None:
                self._net = _net_svg(self._net_param)
            return self._net

    def close(self):
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def serve(run, port=0, host="127.0.0.1", token=None, require_token=None, devices=None):
    """Serve the dashboard of ``run`` (a Solver, a RunRecord, or a log/event file path)
    from a daemon thread; returns the Dashboard (its ``url``, ``record``, ``close()``)."""
    net_param = None
    if isinstance(run, (str, os.PathLike)):
        source = _FileRun(run)
        record = None
    elif isinstance(run, RunRecord):
        source = record = run
    elif hasattr(run, "observers"):           # a Solver
        record = RunRecord()
        Recorder(record, run, devices)
        source = record
        net_param = run.net.net_param
    else:
        raise TypeError("serve() takes a Solver, a RunRecord or the path of a log or "
                        "event file")
    d = Dashboard(source, host, port, token, require_token, net_param)
    d.record = record
    return d


def announce(dashboard, stream=None):
    """Print the dashboard's URL once (it holds the token when one is needed)."""
    stream = stream or sys.stderr
    extra = ("  (bound to a non-local address: only this URL, with its token, opens it)"
             if dashboard.token else "")
    print(f"Dashboard: {dashboard.url}{extra}", file=stream, flush=True)
