"""``/metrics`` over HTTP(S), guarded like the gRPC API when TLS is on.

With TLS a scrape needs a certificate of the gRPC CA (the handshake checks it) that is not revoked (the
server's own deny list, ``revoked/``, as its gRPC interceptor follows it) and whose identity has the
``operator`` or ``metrics`` role (``gpucoord certs issue --role metrics --name prometheus``). Anything else
is 403 with one short line, counted in ``gpucoord_metrics_refusals_total{why}``, never logged per request;
until the deny list has been read every scrape is 403. Without TLS (loopback only) every scrape is served.

A coordinator also serves its read-only fleet console (``coordinator.web``) on this port: every path but
``/metrics`` goes to it once the coordinator has set ``MetricsGate.console``. With TLS the console takes a
live certificate of the ``operator`` or ``viewer`` role, as /metrics takes operator or metrics.
"""
from __future__ import annotations

import socket
import ssl
import threading
from typing import Any, Callable, Iterable
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from coordinator.security.identity import identity_of_certificate, serial_of_certificate
from coordinator.security.revocation import Revocations

SCRAPE_ROLES = ("operator", "metrics")
CONSOLE_ROLES = ("operator", "viewer")
StartResponse = Callable[..., Any]


class MetricsGate:
    """Who may scrape; ``revocations`` is set once the server's interceptor follows the deny list, and
    ``console`` (a WSGI application) once the coordinator serves its console here."""

    def __init__(self) -> None:
        self.revocations: Revocations | None = None
        self.console: Any = None

    def refusal(self, der: bytes | None, roles: tuple[str, ...] = SCRAPE_ROLES) -> str:
        """Why a request by the certificate ``der`` for what ``roles`` may read is refused ("" when it is
        not)."""
        if not der:
            return "certificate"
        pem = ssl.DER_cert_to_PEM_cert(der).encode()
        identity = identity_of_certificate(pem)
        if identity is None:
            return "identity"
        if identity.role not in roles:
            return "role"
        revocations = self.revocations
        if revocations is None or not revocations.ready.is_set():
            return "revocations"
        if revocations.is_revoked(serial_of_certificate(pem)):
            return "revoked"
        return ""


class _PeerHandler(WSGIRequestHandler):
    """Hands the verified client certificate to the application; logs nothing (no line per request)."""

    def get_environ(self) -> dict[str, Any]:
        env = super().get_environ()
        conn = self.connection
        env["gpucoord.peer_der"] = conn.getpeercert(binary_form=True) if isinstance(conn, ssl.SSLSocket) else None
        return env

    def log_message(self, format: str, *args: Any) -> None:
        return


def _guarded(app: Any, gate: MetricsGate, tls: bool, refused: Callable[[str], None]) -> Any:
    def guarded(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        console = gate.console
        to_console = console is not None and environ.get("PATH_INFO", "") != "/metrics"
        if tls:
            roles = CONSOLE_ROLES if to_console else SCRAPE_ROLES
            why = gate.refusal(environ.get("gpucoord.peer_der"), roles)
            if why:
                refused(why)
                what = "the console needs" if to_console else "metrics need"
                body = f"forbidden: {what} a live {' or '.join(roles)} certificate ({why})\n".encode()
                start_response("403 Forbidden", [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
                return [body]
        result: Iterable[bytes] = (console if to_console else app)(environ, start_response)
        return result
    return guarded


def start(host: str, port: int, registry: CollectorRegistry, tls_files: tuple[str, str, str] | None,
          gate: MetricsGate, refused: Callable[[str], None]) -> int:
    """Serve in a daemon thread; the bound port. ``tls_files``: (ca, cert, key) for HTTPS with client
    certificates required."""
    app = _guarded(make_wsgi_app(registry), gate, tls_files is not None, refused)

    class Server(ThreadingWSGIServer):
        address_family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    httpd = make_server(host, port, app, Server, handler_class=_PeerHandler)
    if tls_files is not None:
        ca, cert, key = tls_files
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(cert, key)
        ctx.load_verify_locations(cafile=ca)
        ctx.verify_mode = ssl.CERT_REQUIRED
        httpd.socket = ctx.wrap_socket(httpd.socket, server_side=True)
    threading.Thread(target=httpd.serve_forever, daemon=True, name="metrics").start()
    return int(httpd.server_port)


__all__ = ["CONSOLE_ROLES", "SCRAPE_ROLES", "MetricsGate", "start"]
