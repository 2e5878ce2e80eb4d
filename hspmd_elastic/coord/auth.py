"""Authentication and TLS refusals for ``EtcdClient``: the token, the channel that sends it,
and what each refusal of etcd means.

* ``TokenAuth`` holds one client's auth token: fetched (etcd's ``Authenticate``) on first use,
  sent with every request and stream by ``TokenInterceptor``, dropped when a call finds it stale
  (``is_stale_token``: etcd restarted, the token's TTL ran out, or the auth store moved on), so
  the client fetches a new one and retries; a wrong user or password is ``EtcdAuthError``; an
  etcd with authentication off makes the user unneeded (said once in the log);
* ``tls_refusal`` / ``tls_message``: a failed TLS handshake in one line that says which side's
  certificate was refused; ``denial``: a permission or authentication refusal in one line;
* ``client_security``: the settings made consistent with the endpoints' ``http://`` /
  ``https://`` schemes.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Iterable
from typing import Optional

import grpc
from etcd3 import etcdrpc

from hspmd_elastic.coord.api import EtcdAuthError
from hspmd_elastic.coord.security import EtcdSecurity

log = logging.getLogger("hspmd_elastic.coord.client")

RENEWALS = 3  # stale-token renewals per call before it gives up


class TokenAuth:
    """The auth token of one client: fetched on first use, shared by its calls and streams,
    fetched again once a call finds it stale."""

    def __init__(self, security: EtcdSecurity):
        self.user, self._password = security.user, security.password
        self._lock = threading.Lock()
        self.current: Optional[str] = None
        self._auth_off = False

    def token(self, channel: grpc.Channel, timeout: float, what: str) -> Optional[str]:
        with self._lock:
            if self.current is not None or self._auth_off:
                return self.current
        req = etcdrpc.AuthenticateRequest(name=self.user, password=self._password)
        try:
            resp = etcdrpc.AuthStub(channel).Authenticate(req, timeout)
        except grpc.RpcError as exc:
            details = exc.details() if hasattr(exc, "details") else ""
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION and "not enabled" in details:
                with self._lock:
                    if not self._auth_off:
                        log.warning("etcd has authentication off: user %s is not needed",
                                    self.user)
                    self._auth_off = True
                return None
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise EtcdAuthError(f"{what}: etcd refused user {self.user!r}: wrong user "
                                    "name or password") from exc
            raise
        with self._lock:
            self.current = resp.token
        return resp.token

    def drop(self, stale: Optional[str]) -> None:
        """Forget the token (``stale``: only if it is still that one)."""
        with self._lock:
            if stale is None or self.current == stale:
                self.current = None


class _CallDetails(collections.namedtuple(
        "_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready",
                         "compression")), grpc.ClientCallDetails):
    pass


class TokenInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                       grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds the client's current auth token to every call on a channel."""

    def __init__(self, auth: TokenAuth):
        self._auth = auth

    def _details(self, details):
        token = self._auth.current
        if token is None:
            return details
        metadata = list(details.metadata or ()) + [("token", token)]
        return _CallDetails(details.method, details.timeout, metadata, details.credentials,
                            getattr(details, "wait_for_ready", None),
                            getattr(details, "compression", None))

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)


def is_stale_token(exc: grpc.RpcError) -> bool:
    """etcd no longer knows the token (restarted, or its TTL ran out), or its auth store moved
    on since the token was issued: a new token fixes it."""
    details = (exc.details() if hasattr(exc, "details") else "") or ""
    code = exc.code() if hasattr(exc, "code") else None
    return ((code == grpc.StatusCode.UNAUTHENTICATED and "invalid auth token" in details)
            or "revision of auth store is old" in details)


def is_stale_token_reason(reason: str) -> bool:
    """A watch's cancel reason says its token is stale (see ``is_stale_token``)."""
    return "invalid auth token" in reason or "revision of auth store is old" in reason


_TLS_MARKS = ("handshake failed", "TSI_", "SSL_ERROR", "CERTIFICATE_VERIFY_FAILED",
              "certificate", "Peer name")


def tls_refusal(exc: grpc.RpcError) -> bool:
    details = (exc.details() if hasattr(exc, "details") else "") or ""
    return any(mark.lower() in details.lower() for mark in _TLS_MARKS)


def tls_message(what: str, netloc: str, exc: grpc.RpcError, security: EtcdSecurity) -> str:
    details = exc.details() or ""
    if "WRONG_VERSION_NUMBER" in details:
        why = "etcd there does not serve TLS (use its plain endpoint, without CA or https://)"
    elif "CERTIFICATE_VERIFY_FAILED" in details or "Peer name" in details:
        why = ("etcd's server certificate does not verify against "
               + (f"the CA {security.ca_file}" if security.ca_file else "the system's CAs")
               + " (or does not name that host)")
    elif not security.cert_file:
        why = "etcd wants a client certificate and none was given"
    else:
        why = (f"etcd refused the client certificate {security.cert_file} (not signed by a CA "
               "it trusts?)")
    return f"{what}: TLS handshake with etcd at {netloc} failed: {why} ({_ssl_reason(details)})"


def _ssl_reason(details: str) -> str:
    """The telling part of gRPC's handshake error (``CERTIFICATE_VERIFY_FAILED: ...``)."""
    parts = [p.strip() for p in details.split(":")]
    for i, part in enumerate(parts):
        if part.isupper() and "_" in part and not part.startswith(("SSL_ERROR", "UNKNOWN")):
            return ": ".join(parts[i:i + 2]) if "VERIFY" in part else part
    for part in parts:
        if "TSI_" in part or "handshake" in part.lower():
            return part
    return parts[-1] if parts else details


def denial(details: str, code, security: EtcdSecurity) -> str:
    """What an etcd refusal of this client means, or "" when it is no auth refusal."""
    who = f"user {security.user!r}" if security.user else (
        "the client certificate's user" if security.cert_file else "no user")
    if code == grpc.StatusCode.PERMISSION_DENIED or "permission denied" in details:
        return f"etcd denied the request: {who} has no permission for this key (its roles)"
    if "user name is empty" in details or "user name not found" in details:
        return ("etcd has authentication on and " + (f"knows no {who}" if security.user else
                "this client gave no user: give a user and password"))
    if "authentication failed" in details:
        return f"etcd refused {who}: wrong user name or password"
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return f"etcd did not accept the credentials of {who} ({details})"
    return ""


def endpoint_schemes(endpoints: str | Iterable) -> dict[str, str]:
    """``{entry: "http" | "https"}`` for the entries of ``endpoints`` that name a scheme."""
    entries = endpoints.split(",") if isinstance(endpoints, str) else [
        e for ep in endpoints if isinstance(ep, str) for e in ep.split(",")]
    out = {}
    for entry in (e.strip() for e in entries):
        for scheme in ("http", "https"):
            if entry.startswith(scheme + "://"):
                out[entry] = scheme
    return out


def client_security(endpoints: str | Iterable,
                    security: Optional[EtcdSecurity]) -> EtcdSecurity:
    """``security`` made consistent with the endpoints' schemes (``https://`` turns TLS on)."""
    security = security or EtcdSecurity()
    schemes = endpoint_schemes(endpoints)
    if "https" in schemes.values():
        if "http" in schemes.values():
            raise ValueError("etcd endpoints mix http:// and https://: "
                             + ",".join(schemes))
        security = security.with_tls()
    elif "http" in schemes.values() and security.uses_tls:
        plain = next(e for e, s in schemes.items() if s == "http")
        raise ValueError(f"etcd endpoint {plain!r} is plain http:// but TLS is configured (a "
                         "CA or client certificate): use https:// or host:port")
    return security
