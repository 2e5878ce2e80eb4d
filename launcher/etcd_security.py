"""The etcd TLS and authentication options of ``hspmd-launch`` and its subcommands.

One definition of the options, shared by every command that talks to etcd, and the one
translation of them into ``hspmd_elastic.coord.EtcdSecurity``:

* the launcher: ``--hspmd-etcd-cacert``, ``--hspmd-etcd-cert``, ``--hspmd-etcd-key``,
  ``--hspmd-etcd-user``, ``--hspmd-etcd-password-file`` (``launcher_options``,
  ``launcher_security``), and for an etcd the agent runs itself (``--standalone``, the c10d and
  static stores) ``--hspmd-etcd-server-cert`` / ``--hspmd-etcd-server-key`` (``server_tls``);
* the subcommands (``status``, ``dashboard``, ``inject``): ``--etcd-cacert``, ``--etcd-cert``,
  ``--etcd-key``, ``--etcd-user``, ``--etcd-password-file`` (``subcommand_options``,
  ``subcommand_security``);
* each option also comes from ``HSPMD_ETCD_CACERT``, ``HSPMD_ETCD_CERT``, ``HSPMD_ETCD_KEY``,
  ``HSPMD_ETCD_USER``, ``HSPMD_ETCD_PASSWORD_FILE`` (``HSPMD_ETCD_SERVER_CERT`` /
  ``HSPMD_ETCD_SERVER_KEY``); the password itself only from ``HSPMD_ETCD_PASSWORD`` or the
  file, never from the command line;
* an unusable value is one line naming the flag and the value (exit 2).
"""

from __future__ import annotations

import os
from typing import Optional

import click

from hspmd_elastic.contract.env import (
    ETCD_CACERT_ENV as ENV_CACERT,
    ETCD_CERT_ENV as ENV_CERT,
    ETCD_KEY_ENV as ENV_KEY,
    ETCD_PASSWORD_ENV as ENV_PASSWORD,
    ETCD_PASSWORD_FILE_ENV as ENV_PASSWORD_FILE,
    ETCD_SERVER_CERT_ENV as ENV_SERVER_CERT,
    ETCD_SERVER_KEY_ENV as ENV_SERVER_KEY,
    ETCD_USER_ENV as ENV_USER,
)
from hspmd_elastic.coord.security import EtcdSecurity, EtcdSecurityError
from launcher.api import ConfigError, EtcdServerTLS

# EtcdSecurity field -> (option suffix, environment variable, help)
_CLIENT = {
    "ca_file": ("cacert", ENV_CACERT, "CA file (PEM) that verifies etcd's server certificate; "
                "turns TLS on."),
    "cert_file": ("cert", ENV_CERT, "Client certificate (PEM) for etcd's --client-cert-auth."),
    "key_file": ("key", ENV_KEY, "Private key (PEM) of the client certificate."),
    "user": ("user", ENV_USER, f"etcd user (auth enabled); its password comes from "
             f"${ENV_PASSWORD} or the password file, never the command line."),
    "password_file": ("password-file", ENV_PASSWORD_FILE, "File holding the etcd user's "
                      "password (first line)."),
}
_SERVER = {
    "cert_file": ("server-cert", ENV_SERVER_CERT, "Embedded etcd (--standalone, c10d, static): "
                  "serve TLS with this certificate (PEM); with --hspmd-etcd-cacert clients "
                  "must also show a certificate signed by that CA."),
    "key_file": ("server-key", ENV_SERVER_KEY, "Embedded etcd: private key of "
                 "--hspmd-etcd-server-cert."),
}
_META = "hspmd_etcd_security"


def _flag(prefix: str, suffix: str) -> str:
    return f"--{prefix}etcd-{suffix}"


def _names(prefix: str) -> dict[str, str]:
    return {attr: _flag(prefix, suffix) for attr, (suffix, _, _) in _CLIENT.items()}


# ---------------------------------------------------------------------------------- launcher
def launcher_options(fn):
    """``--hspmd-etcd-*`` options of ``hspmd-launch`` (dashes or underscores)."""
    for attr, (suffix, env, text) in reversed([*_CLIENT.items(),
                                               *(("server_" + a, v) for a, v in
                                                 _SERVER.items())]):
        flag = _flag("hspmd-", suffix)
        dest = flag[2:].replace("-", "_")
        fn = click.option(flag, "--" + dest, dest, envvar=env, show_envvar=True, default=None,
                          help=text)(fn)
    return fn


def launcher_security(params: dict) -> EtcdSecurity:
    """The agent's client settings from ``hspmd-launch``'s params; ``ConfigError`` names the
    bad flag and value."""
    given = {attr: params.get("hspmd_etcd_" + suffix.replace("-", "_"))
             for attr, (suffix, _, _) in _CLIENT.items()}
    security = _checked(given, "hspmd-", ConfigError)
    spec = params.get("hspmd_etcd_endpoints") or params.get("rdzv_endpoint") or ""
    return security.with_tls() if "https://" in spec else security


def server_tls(params: dict, rdzv) -> Optional[EtcdServerTLS]:
    """``--hspmd-etcd-server-cert`` / ``-key``: TLS for the etcd this agent runs (None: plain).
    ``rdzv``: the ``RendezvousSettings`` (only ``--standalone`` and the c10d/static store run
    one)."""
    cert, key = params.get("hspmd_etcd_server_cert"), params.get("hspmd_etcd_server_key")
    if not cert and not key:
        return None
    if not (rdzv.standalone or rdzv.host_etcd):
        raise ConfigError(f"{_flag('hspmd-', 'server-cert')} {cert or key!r} is only used when "
                          "the agent runs etcd itself (--standalone, or --rdzv-backend c10d or "
                          "static)")
    if not (cert and key):
        given, missing = (("server-cert", "server-key") if cert else ("server-key",
                                                                      "server-cert"))
        raise ConfigError(f"{_flag('hspmd-', given)} {cert or key!r} needs "
                          f"{_flag('hspmd-', missing)} too")
    probe = EtcdSecurity(cert_file=cert, key_file=key)
    try:
        probe.checked({"cert_file": _flag("hspmd-", "server-cert"),
                       "key_file": _flag("hspmd-", "server-key")})
    except EtcdSecurityError as exc:
        raise ConfigError(str(exc)) from None
    ca = params.get("hspmd_etcd_cacert")
    return EtcdServerTLS(cert_file=os.path.abspath(cert), key_file=os.path.abspath(key),
                         client_ca_file=os.path.abspath(ca) if ca else None)


# ------------------------------------------------------------------------------- subcommands
def _remember(ctx: click.Context, param: click.Parameter, value):
    ctx.meta.setdefault(_META, {})[param.name] = value
    return value


def subcommand_options(fn):
    """``--etcd-*`` options of a subcommand; read them back with ``subcommand_security()``."""
    for attr, (suffix, env, text) in reversed(list(_CLIENT.items())):
        fn = click.option(_flag("", suffix), attr, envvar=env, show_envvar=True, default=None,
                          expose_value=False, callback=_remember, help=text)(fn)
    return fn


def subcommand_security(ctx: Optional[click.Context] = None) -> EtcdSecurity:
    """The settings a subcommand's ``--etcd-*`` options give; a bad one is a usage error (one
    line naming the flag and value, exit 2)."""
    ctx = ctx or click.get_current_context()
    return _checked(ctx.meta.get(_META, {}), "", click.UsageError)


# ----------------------------------------------------------------------------------- shared
def _checked(given: dict, prefix: str, error: type) -> EtcdSecurity:
    """``given``: EtcdSecurity field -> option value (None when not given)."""
    security = EtcdSecurity(ca_file=given.get("ca_file") or None,
                            cert_file=given.get("cert_file") or None,
                            key_file=given.get("key_file") or None,
                            user=given.get("user") or None,
                            password=os.environ.get(ENV_PASSWORD) or None,
                            password_file=given.get("password_file") or None)
    if not (security.uses_tls or security.uses_auth or security.password_file):
        return EtcdSecurity()
    try:
        return security.checked(_names(prefix))
    except EtcdSecurityError as exc:
        raise error(str(exc)) from None
