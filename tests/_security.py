"""A certificate authority made with the ``openssl`` command line, and an etcd that serves TLS
with ``--client-cert-auth`` and has authentication on, for the security tests.

``Pki(dir)`` makes a CA, a server certificate for 127.0.0.1/localhost, a client certificate,
and a second CA with a client certificate of its own (one etcd does not trust). ``SecureEtcd``
starts one member with them (``launcher.standalone.EtcdCluster(tls=...)``) and sets up, through
etcd's Auth API, the users and roles docs/security.md describes: ``root``; ``job`` (role
``hspmd-job-<job>``: readwrite on ``/hspmd/v1/jobs/<job>/``); ``viewer`` (role
``hspmd-read-<job>``: read on the same prefix); then turns authentication on.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import grpc
from etcd3 import etcdrpc
from etcd3.etcdrpc import auth_pb2

from hspmd_elastic.contract import schema
from hspmd_elastic.coord.client import prefix_range_end
from hspmd_elastic.coord.security import EtcdSecurity
from launcher.api import EtcdServerTLS
from launcher.standalone import EtcdCluster

PASSWORDS = {"root": "root-secret", "job": "job-secret-7f3a", "viewer": "viewer-secret"}
RPC_TIMEOUT_S = 10.0


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, timeout=30,
                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


class Pki:
    """PEM files under ``directory``: ``ca``, ``server``, ``client`` and an untrusted
    ``rogue`` client (its own CA). EC P-256 keys: fast to make."""

    def __init__(self, directory: Path):
        self.dir = directory
        directory.mkdir(parents=True, exist_ok=True)
        newkey = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
        for ca in ("ca", "rogue-ca"):
            _openssl("req", "-x509", *newkey, "-keyout", f"{ca}.key", "-out", f"{ca}.crt",
                     "-days", "2", "-subj", f"/CN=hspmd-test-{ca}", cwd=directory)
        for name, ca, ext in (
                ("server", "ca", "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                                 "extendedKeyUsage=serverAuth,clientAuth\n"),
                ("client", "ca", "extendedKeyUsage=clientAuth\n"),
                ("rogue", "rogue-ca", "extendedKeyUsage=clientAuth\n")):
            (directory / f"{name}.ext").write_text(ext)
            _openssl("req", *newkey, "-keyout", f"{name}.key", "-out", f"{name}.csr",
                     "-subj", f"/CN=hspmd-test-{name}", cwd=directory)
            _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey",
                     f"{ca}.key", "-CAcreateserial", "-out", f"{name}.crt", "-days", "2",
                     "-extfile", f"{name}.ext", cwd=directory)

    def path(self, name: str) -> str:
        return str(self.dir / name)

    def server_tls(self) -> EtcdServerTLS:
        return EtcdServerTLS(self.path("server.crt"), self.path("server.key"),
                             self.path("ca.crt"))

    def security(self, user: str | None = None, password: str | None = None,
                 cert: str | None = "client") -> EtcdSecurity:
        """Client settings: the CA, ``cert``'s certificate (None: none), ``user``."""
        if user and password is None:
            password = PASSWORDS[user]
        return EtcdSecurity(ca_file=self.path("ca.crt"),
                            cert_file=self.path(f"{cert}.crt") if cert else None,
                            key_file=self.path(f"{cert}.key") if cert else None,
                            user=user, password=password if user else None).checked()


class SecureEtcd:
    """One etcd member serving TLS with client-certificate auth, RBAC on for ``job``."""

    def __init__(self, tmp: Path, pki: Pki, job: str):
        self.pki, self.job = pki, job
        self.cluster = EtcdCluster(size=1, base_dir=str(tmp / "etcd-tls"), tls=pki.server_tls())
        self.cluster.start()
        try:
            self._setup_rbac()
        except BaseException:
            self.cluster.stop()
            raise

    @property
    def endpoint(self) -> str:
        return self.cluster.endpoint_str

    @property
    def member(self):
        return self.cluster.members[0]

    def _setup_rbac(self) -> None:
        pki = self.pki
        creds = grpc.ssl_channel_credentials(
            Path(pki.path("ca.crt")).read_bytes(), Path(pki.path("client.key")).read_bytes(),
            Path(pki.path("client.crt")).read_bytes())
        prefix = schema.job_prefix(self.job).encode()
        with grpc.secure_channel(self.endpoint, creds) as channel:
            auth = etcdrpc.AuthStub(channel)
            for user, password in PASSWORDS.items():
                auth.UserAdd(etcdrpc.AuthUserAddRequest(name=user, password=password),
                             RPC_TIMEOUT_S)
            grants = (("root", "root", None),
                      ("job", f"hspmd-job-{self.job}", auth_pb2.Permission.READWRITE),
                      ("viewer", f"hspmd-read-{self.job}", auth_pb2.Permission.READ))
            for user, role, kind in grants:
                if kind is not None:
                    auth.RoleAdd(etcdrpc.AuthRoleAddRequest(name=role), RPC_TIMEOUT_S)
                    perm = auth_pb2.Permission(permType=kind, key=prefix,
                                               range_end=prefix_range_end(prefix))
                    auth.RoleGrantPermission(
                        etcdrpc.AuthRoleGrantPermissionRequest(name=role, perm=perm),
                        RPC_TIMEOUT_S)
                auth.UserGrantRole(etcdrpc.AuthUserGrantRoleRequest(user=user, role=role),
                                   RPC_TIMEOUT_S)
            auth.AuthEnable(etcdrpc.AuthEnableRequest(), RPC_TIMEOUT_S)

    def env(self, user: str | None, cert: str | None = "client",
            password: str | None = None) -> dict[str, str]:
        """``HSPMD_ETCD_*`` for a tool or agent: the CA, ``cert``, ``user`` (password in the
        environment)."""
        env = {"HSPMD_ETCD_CACERT": self.pki.path("ca.crt")}
        if cert:
            env.update(HSPMD_ETCD_CERT=self.pki.path(f"{cert}.crt"),
                       HSPMD_ETCD_KEY=self.pki.path(f"{cert}.key"))
        if user:
            env.update(HSPMD_ETCD_USER=user,
                       HSPMD_ETCD_PASSWORD=password or PASSWORDS[user])
        return env

    def stop(self) -> None:
        self.cluster.stop()


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any ``HSPMD_ETCD_*`` setting, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HSPMD_ETCD_")}
    env.update(extra)
    return env
