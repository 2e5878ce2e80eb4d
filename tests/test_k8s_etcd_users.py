"""The etcd-users Job of examples/kubernetes/etcd.yaml on a real etcd (``tests/_k8s.py`` reads
the manifests): its script gives each client certificate the manifests make exactly the access
its common name names.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from _k8s import SAMPLE_FIELDS, expand, load_docs, of_kind, pod_env
from _security import Pki, _openssl  # tests/ is on sys.path

from hspmd_elastic.contract.keys import job_prefix
from hspmd_elastic.coord import EtcdClient
from hspmd_elastic.coord.api import EtcdAuthError
from hspmd_elastic.coord.security import EtcdSecurity
from launcher.standalone import EtcdCluster

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def docs() -> list[dict]:
    return load_docs()


def test_the_etcd_users_job_on_a_real_etcd(docs, tmp_path):
    """The etcd-users Job's script, run twice (the Job retries it) with etcdctl and the root
    certificate against a real etcd that serves TLS with --client-cert-auth; then every client
    certificate the manifests make is the etcd user its common name names: the job's reads and
    writes its own prefix only, the viewer only reads it, any other name gets nothing."""
    assert shutil.which("etcdctl"), \
        "etcdctl is missing (Debian's etcd-client, which scripts/test installs)"
    job_cert = next(c for c in of_kind(docs, "Certificate").values()
                    if c["spec"]["commonName"] not in ("root", "viewer", "etcd")
                    and not c["spec"].get("isCA"))
    names = {"root", "viewer", job_cert["spec"]["commonName"]}
    assert {c["spec"].get("commonName") for c in of_kind(docs, "Certificate").values()} >= names
    pki = Pki(tmp_path / "pki")
    for cn in names:
        _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                 "-keyout", f"{cn}.key", "-out", f"{cn}.csr", "-subj", f"/CN={cn}", cwd=pki.dir)
        _openssl("x509", "-req", "-in", f"{cn}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                 "-CAcreateserial", "-out", f"{cn}.crt", "-days", "2", "-extfile", "client.ext",
                 cwd=pki.dir)
    (container,) = of_kind(docs, "Job")["etcd-users"]["spec"]["template"]["spec"]["containers"]
    env = pod_env(container, "etcd-users", SAMPLE_FIELDS)
    job = env["JOB_ID"]
    argv = [expand(a, env, "etcd-users") for a in [*container["command"], *container["args"]]]

    def client(cn: str) -> EtcdClient:
        security = EtcdSecurity(ca_file=pki.path("ca.crt"), cert_file=pki.path(f"{cn}.crt"),
                                key_file=pki.path(f"{cn}.key")).checked()
        return EtcdClient(cluster.endpoint_str, timeout=5.0, security=security)

    with EtcdCluster(size=1, base_dir=str(tmp_path / "etcd"), tls=pki.server_tls()) as cluster:
        env.update(ETCDCTL_ENDPOINTS=f"https://{cluster.endpoint_str}", PATH=os.environ["PATH"],
                   ETCDCTL_CACERT=pki.path("ca.crt"), ETCDCTL_CERT=pki.path("root.crt"),
                   ETCDCTL_KEY=pki.path("root.key"))
        for _ in range(2):
            run = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
            assert run.returncode == 0, run.stderr
        own, other = job_prefix(job), job_prefix(job + "-other")
        with client(job) as c:
            c.put(own + "k", "v")
            assert c.count_prefix(own) == 1 and c.delete(own + "access-check") is False
            with pytest.raises(EtcdAuthError, match="no permission"):
                c.put(other + "k", "v")
        with client("viewer") as c:
            assert c.count_prefix(own) == 1
            with pytest.raises(EtcdAuthError, match="no permission"):
                c.put(own + "k", "w")
            with pytest.raises(EtcdAuthError, match="no permission"):
                c.count_prefix(other)
        with client("client") as c:  # a certificate of the same CA, CN=hspmd-test-client
            with pytest.raises(EtcdAuthError):
                c.count_prefix(own)
