"""The live dashboard of a job: a small read-only HTTP server over a ``JobStateCache``.

Routes (GET and HEAD only; anything else is 405, unknown paths 404):

* ``/``: one self-contained HTML page (inline CSS/JS/SVG, nothing fetched from elsewhere): the
  cluster map, the plan as pipelines x stages, the events timeline with switch durations and the
  step-throughput chart; it loads ``/api/state`` and then follows ``/api/stream``;
* ``/api/state``: the status document (``JobView.document()``, as ``status --json``);
* ``/api/stream``: Server-Sent Events, one ``state`` event with the whole document per change
  of the cache (the cache follows an etcd watch: no polling anywhere), keep-alive comments
  between changes;
* ``/metrics``: Prometheus text format from ``metrics.JobCollector``;
* ``/healthz``: ``ok``.

Access (``access.py``): every request is refused 403 unless its ``Host`` header names the bound
address (or an ``allow_hosts`` name), and, with a token, 401 unless it carries
``Authorization: Bearer <token>``; a dashboard bound to a non-loopback address refuses to start
without a token. HEAD answers as GET without the body. Every answer says ``nosniff``, no
referrer and no framing; the page's Content-Security-Policy lets only its own inline script run
and connect to its own origin.

Promises: binds ``127.0.0.1`` unless told otherwise; serves only the one job's prefix; writes
nothing to etcd; every socket has a timeout, so a stalled client cannot pin a thread forever;
``stop()`` ends the streams and the server within its timeout.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterable, Optional
from urllib.parse import urlsplit

from launcher.ops.access import HostCheck, is_loopback, token_matches
from launcher.ops.api import DEFAULT_HOST, DashboardError
from launcher.ops.metrics import CONTENT_TYPE, exposition, make_registry
from launcher.ops.page import CSP, PAGE
from launcher.ops.safe import clean
from launcher.ops.state import JobStateCache

log = logging.getLogger(__name__)

SOCKET_TIMEOUT_S = 30.0
STREAM_TICK_S = 0.5  # how often a stream checks for shutdown while nothing changes
KEEPALIVE_S = 15.0
MIN_PUSH_INTERVAL_S = 0.2  # coalesce bursts of changes into one push
SECURITY_HEADERS = {"X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
                    "X-Frame-Options": "DENY"}


class DashboardServer:
    """Serve ``cache``'s job on ``host:port`` (port 0: any free port; see ``url``).

    ``allow_hosts``: more names the ``Host`` header may carry; ``token``: the bearer token every
    request must carry (required when ``host`` is not a loopback address)."""

    def __init__(self, cache: JobStateCache, host: str = DEFAULT_HOST, port: int = 0,
                 allow_hosts: Iterable[str] = (), token: Optional[str] = None):
        if not token and not is_loopback(host):
            raise DashboardError(f"refusing to serve on non-loopback address {host!r} without "
                                 "a token: give --token-file PATH, or bind 127.0.0.1")
        self.cache = cache
        self.token = token or None
        self.stopping = threading.Event()
        self.registry = make_registry(cache.view)
        handler = type("Handler", (_Handler,), {"dashboard": self})
        try:
            self.httpd = ThreadingHTTPServer((host, port), handler)
        except OSError as exc:
            raise DashboardError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") \
                from exc
        self.httpd.daemon_threads = True
        self.hosts = HostCheck(host, allow_hosts)
        self._thread: Optional[threading.Thread] = None

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.httpd.server_address[:2]
        return str(host), int(port)

    @property
    def url(self) -> str:
        host, port = self.address
        return f"http://{host}:{port}/"

    def start(self) -> "DashboardServer":
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={
            "poll_interval": 0.2}, name="dashboard http", daemon=True)
        self._thread.start()
        return self

    def serve_until(self, stop: threading.Event) -> None:
        """Serve in this thread's stead until ``stop`` is set (the CLI's foreground loop)."""
        self.start()
        while not stop.wait(0.5):
            pass

    def stop(self, timeout: float = 5.0) -> None:
        self.stopping.set()
        if self._thread is not None:
            self.httpd.shutdown()
            self._thread.join(timeout)
        self.httpd.server_close()

    def __enter__(self) -> "DashboardServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


_HTML_SAFE = str.maketrans({"<": "\\u003c", ">": "\\u003e", "&": "\\u0026"})


def _json(doc, **kw) -> str:
    """JSON with ``<``, ``>`` and ``&`` escaped (they occur only inside strings), so no value
    reads as markup to anything that looks at the bytes."""
    return json.dumps(doc, **kw).translate(_HTML_SAFE)


class _Handler(BaseHTTPRequestHandler):
    dashboard: DashboardServer
    timeout = SOCKET_TIMEOUT_S
    protocol_version = "HTTP/1.1"
    server_version = "hspmd-dashboard"

    def log_message(self, fmt: str, *args) -> None:  # quiet by default; debug on request
        log.debug("dashboard %s: " + fmt, self.address_string(), *args)

    head_only = False

    def _allowed(self) -> bool:
        """The Host and token checks; False once a refusal was sent."""
        host = self.headers.get("Host")
        if not self.dashboard.hosts.allows(host):
            self._send(HTTPStatus.FORBIDDEN, "text/plain; charset=utf-8",
                       f"host {clean(host or '(none)', 100)!r} is not served here (hspmd-launch "
                       "dashboard --allow-host NAME adds a name)\n".encode())
            return False
        token = self.dashboard.token
        if token is not None and not token_matches(self.headers.get("Authorization"), token):
            self._send(HTTPStatus.UNAUTHORIZED, "text/plain; charset=utf-8",
                       b"this dashboard needs Authorization: Bearer <token>\n",
                       extra={"WWW-Authenticate": 'Bearer realm="hspmd-dashboard"'})
            return False
        return True

    def do_HEAD(self) -> None:  # noqa: N802
        self.head_only = True
        try:
            self.do_GET()
        finally:
            self.head_only = False

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        if not self._allowed():
            return
        path = urlsplit(self.path).path
        routes = {"/": self._page, "/index.html": self._page, "/api/state": self._state,
                  "/api/stream": self._stream, "/metrics": self._metrics,
                  "/healthz": self._healthz}
        route = routes.get(path)
        if route is None:
            self._send(HTTPStatus.NOT_FOUND, "text/plain; charset=utf-8",
                       f"no such page: {path}\n".encode())
            return
        try:
            route()
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            log.debug("dashboard: client %s went away", self.address_string())

    def _refuse(self) -> None:
        if self._allowed():
            self._send(HTTPStatus.METHOD_NOT_ALLOWED, "text/plain; charset=utf-8",
                       b"read-only dashboard: GET and HEAD only\n", extra={"Allow": "GET, HEAD"})

    do_POST = do_PUT = do_DELETE = do_PATCH = _refuse  # noqa: N815

    def _send(self, status: HTTPStatus, ctype: str, body: bytes,
              extra: Optional[dict[str, str]] = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        for k, v in {**SECURITY_HEADERS, **(extra or {})}.items():
            self.send_header(k, v)
        self.end_headers()
        if not self.head_only:
            self.wfile.write(body)

    def _page(self) -> None:
        self._send(HTTPStatus.OK, "text/html; charset=utf-8", PAGE.encode("utf-8"),
                   extra={"Content-Security-Policy": CSP})

    def _state(self) -> None:
        doc = self.dashboard.cache.view().document()
        self._send(HTTPStatus.OK, "application/json", _json(doc).encode("utf-8"))

    def _metrics(self) -> None:
        self._send(HTTPStatus.OK, CONTENT_TYPE, exposition(self.dashboard.registry))

    def _healthz(self) -> None:
        self._send(HTTPStatus.OK, "text/plain; charset=utf-8", b"ok\n")

    def _stream(self) -> None:
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-store")
        self.send_header("Connection", "close")
        for k, v in SECURITY_HEADERS.items():
            self.send_header(k, v)
        self.end_headers()
        self.close_connection = True
        if self.head_only:
            return
        cache, stopping = self.dashboard.cache, self.dashboard.stopping
        version, last_write = -1, time.monotonic()
        self.wfile.write(b"retry: 1000\n\n")
        while not stopping.is_set():
            current = cache.wait_changed(version, STREAM_TICK_S)
            if stopping.is_set():
                break
            if current == version:
                if time.monotonic() - last_write >= KEEPALIVE_S:
                    self.wfile.write(b": keep-alive\n\n")
                    self.wfile.flush()
                    last_write = time.monotonic()
                continue
            version = current
            data = _json(cache.view().document(), separators=(",", ":"))
            self.wfile.write(f"id: {version}\nevent: state\ndata: {data}\n\n".encode("utf-8"))
            self.wfile.flush()
            last_write = time.monotonic()
            stopping.wait(MIN_PUSH_INTERVAL_S)
