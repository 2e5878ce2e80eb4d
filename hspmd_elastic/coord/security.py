"""``EtcdSecurity``: how an etcd client checks etcd and proves who it is (TLS, user and password).

Every process that talks to etcd (agents, the leader, elastic workers, ``status``, the
dashboard, ``inject``) builds its ``EtcdClient`` with one of these. Promises:

* the default is a plain client (no TLS, no user), as before;
* TLS is on when a CA file, a client certificate or an ``https://`` endpoint is given: the CA
  verifies etcd's server certificate (without one, the system's roots do), the client
  certificate and key answer etcd's ``--client-cert-auth``;
* with a user, the client authenticates (etcd's ``Authenticate``) and sends the token with every
  request; the password never comes from a command line (where ``ps`` shows it): it comes from
  ``HSPMD_ETCD_PASSWORD`` or from a file (``HSPMD_ETCD_PASSWORD_FILE``, or a flag naming one);
* ``checked(names)`` reads every file once and raises ``EtcdSecurityError`` (a ``ValueError``)
  with one line naming the option (``names`` maps a field to its flag, default its environment
  variable) and the bad value: a missing or unreadable file, a file that is not PEM, a
  certificate without its key, a user without a password;
* ``to_env()`` / ``from_env()`` carry the settings to child processes through ``HSPMD_ETCD_*``
  variables (paths made absolute; the password only as the variable it came from, or as the
  path of its file).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Mapping, Optional

import grpc

from hspmd_elastic.contract.env import (  # the variables' names: defined in the contract
    ETCD_CACERT_ENV as ENV_CACERT,
    ETCD_CERT_ENV as ENV_CERT,
    ETCD_KEY_ENV as ENV_KEY,
    ETCD_PASSWORD_ENV as ENV_PASSWORD,
    ETCD_PASSWORD_FILE_ENV as ENV_PASSWORD_FILE,
    ETCD_TLS_ENV as ENV_TLS,  # "1": TLS with the system's roots (https:// endpoints, no CA file)
    ETCD_USER_ENV as ENV_USER,
)
# field -> the environment variable it travels in (also the default name in error messages)
ENV_NAMES: dict[str, str] = {
    "ca_file": ENV_CACERT,
    "cert_file": ENV_CERT,
    "key_file": ENV_KEY,
    "user": ENV_USER,
    "password": ENV_PASSWORD,
    "password_file": ENV_PASSWORD_FILE,
}
_MAX_FILE_BYTES = 1 << 20


class EtcdSecurityError(ValueError):
    """A TLS or authentication option is unusable (one line naming the option and value)."""


@dataclass(frozen=True)
class EtcdSecurity:
    """TLS and authentication settings of an etcd client; see the module docstring."""

    ca_file: Optional[str] = None
    cert_file: Optional[str] = None
    key_file: Optional[str] = None
    user: Optional[str] = None
    password: Optional[str] = field(default=None, repr=False)
    password_file: Optional[str] = None
    tls: bool = False  # TLS even without a CA file or certificate (https:// endpoints)
    # file contents, read once by checked(): (ca, key, cert) PEM bytes
    _pem: Optional[tuple] = field(default=None, repr=False, compare=False)

    @property
    def uses_tls(self) -> bool:
        return bool(self.tls or self.ca_file or self.cert_file)

    @property
    def uses_auth(self) -> bool:
        return bool(self.user)

    def with_tls(self) -> "EtcdSecurity":
        return self if self.tls else replace(self, tls=True)

    def describe(self) -> str:
        """A short account for logs (never the password)."""
        parts = []
        if self.uses_tls:
            tls = f"TLS (CA {self.ca_file})" if self.ca_file else "TLS (system CAs)"
            parts.append(tls + (f", client certificate {self.cert_file}" if self.cert_file
                                else ""))
        if self.user:
            parts.append(f"user {self.user}")
        return ", ".join(parts) or "plain (no TLS, no user)"

    # ------------------------------------------------------------------------------ checks
    def checked(self, names: Mapping[str, str] = ENV_NAMES) -> "EtcdSecurity":
        """These settings with every file read and checked (see the module docstring)."""
        name = {**ENV_NAMES, **names}
        if bool(self.cert_file) != bool(self.key_file):
            given, missing = (("cert_file", "key_file") if self.cert_file
                              else ("key_file", "cert_file"))
            raise EtcdSecurityError(
                f"{name[given]} {getattr(self, given)!r} needs {name[missing]} too (a client "
                "certificate and its private key)")
        password = self.password
        if self.password_file:
            if not self.user:
                raise EtcdSecurityError(f"{name['password_file']} {self.password_file!r} is "
                                        f"given without a user ({name['user']})")
            password = _read(self.password_file, name["password_file"]).decode(
                "utf-8", "replace").rstrip("\r\n")
            if not password:
                raise EtcdSecurityError(
                    f"{name['password_file']} {self.password_file!r} is empty")
        if self.user and not password:
            raise EtcdSecurityError(
                f"{name['user']} {self.user!r} needs a password: set {ENV_PASSWORD} or give "
                f"{name['password_file']} (never on the command line)")
        pem = (
            _read_pem(self.ca_file, name["ca_file"], "CERTIFICATE") if self.ca_file else None,
            _read_pem(self.key_file, name["key_file"], "PRIVATE KEY") if self.key_file else None,
            _read_pem(self.cert_file, name["cert_file"], "CERTIFICATE") if self.cert_file
            else None,
        )
        return replace(self, password=password if self.user else None,
                       ca_file=_abs(self.ca_file), cert_file=_abs(self.cert_file),
                       key_file=_abs(self.key_file), password_file=_abs(self.password_file),
                       _pem=pem)

    def channel_credentials(self):
        """gRPC channel credentials for TLS (files read by ``checked()`` if not yet)."""
        pem = self._pem if self._pem is not None else self.checked()._pem
        ca, key, cert = pem
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key,
                                            certificate_chain=cert)

    # ---------------------------------------------------------------------------- transport
    def to_env(self) -> dict[str, str]:
        """``HSPMD_ETCD_*`` variables that give a child process these settings."""
        env = {}
        for attr in ("ca_file", "cert_file", "key_file", "user"):
            value = getattr(self, attr)
            if value:
                env[ENV_NAMES[attr]] = _abs(value) if attr != "user" else value
        if self.user and self.password_file:
            env[ENV_PASSWORD_FILE] = _abs(self.password_file)
        elif self.user and self.password:
            env[ENV_PASSWORD] = self.password
        if self.tls and not self.ca_file:
            env[ENV_TLS] = "1"
        return env

    @classmethod
    def from_env(cls, env: Optional[Mapping[str, str]] = None) -> "EtcdSecurity":
        """The settings ``HSPMD_ETCD_*`` give (unchecked: call ``checked()``)."""
        env = os.environ if env is None else env

        def get(var: str) -> Optional[str]:
            return env.get(var) or None

        return cls(ca_file=get(ENV_CACERT), cert_file=get(ENV_CERT), key_file=get(ENV_KEY),
                   user=get(ENV_USER), password=get(ENV_PASSWORD),
                   password_file=None if get(ENV_PASSWORD) else get(ENV_PASSWORD_FILE),
                   tls=env.get(ENV_TLS, "") in ("1", "true", "yes"))


def _abs(path: Optional[str]) -> Optional[str]:
    return os.path.abspath(path) if path else path


def _read(path: str, option: str) -> bytes:
    try:
        with open(path, "rb") as fh:
            data = fh.read(_MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise EtcdSecurityError(f"{option} {path!r}: {exc.strerror or exc}") from None
    if len(data) > _MAX_FILE_BYTES:
        raise EtcdSecurityError(f"{option} {path!r}: larger than 1 MiB, not a key or "
                                "certificate file")
    return data


def _read_pem(path: str, option: str, kind: str) -> bytes:
    data = _read(path, option)
    if b"-----BEGIN" not in data or kind.encode() not in data:
        raise EtcdSecurityError(f"{option} {path!r}: not a PEM file with a {kind.lower()}")
    return data
