"""The agent's progress bar for long waits: the pure state -> bar fields mapping, the switch
tracker, the bar's terminal-only drawing, and one real rendezvous wait under a pseudo-terminal
(two agents, real etcd: the first one shows a progress line while it waits for the second)."""

from __future__ import annotations

import fcntl
import io
import os
import pty
import select
import struct
import subprocess
import termios
import threading
import time
import uuid

import pytest

from launch_harness import LAUNCH, REPO, SCRIPTS, Launcher, base_env
from _events import change, done, event, failed, replan

from hspmd_elastic.contract import schema
from hspmd_elastic.coord.client import EtcdClient
from hspmd_elastic.coord.journal import append_event
from launcher.console import (
    BarFields,
    ElasticWaits,
    PlanWait,
    RendezvousWait,
    SwitchTracker,
    SwitchWait,
    WaitBar,
    bar_fields,
)
from launcher.jobview import Table, WatchedJob


# ------------------------------------------------------------------------------ pure fields
def test_rendezvous_fields_count_nodes_against_max_and_show_the_join_timeout():
    f = bar_fields(RendezvousWait(round=3, state="joining", joined=1, min_nodes=2, max_nodes=4,
                                  waited_s=5.0, timeout_left_s=54.6))
    assert f == BarFields("rendezvous", "rendezvous round 3: nodes joined", 1, 4,
                          "need 2..4; timeout 55s")


def test_rendezvous_fields_last_call_countdown_and_fixed_size():
    f = bar_fields(RendezvousWait(round=0, state="joining", joined=2, min_nodes=2, max_nodes=2,
                                  waited_s=1.0, timeout_left_s=10.0, last_call_left_s=0.44))
    assert (f.completed, f.total) == (2, 2)
    assert f.status == "last call 0.4s; timeout 10s"
    late = bar_fields(RendezvousWait(0, "joining", 2, 2, 2, 1.0, -1.0, last_call_left_s=-0.2))
    assert late.status == "last call 0.0s; timeout 0s"
    f = bar_fields(RendezvousWait(0, "joining", 0, 2, 2, 0.0, 30.0))
    assert f.status == "need 2; timeout 30s"


def test_rendezvous_fields_when_the_round_closed_without_this_node():
    f = bar_fields(RendezvousWait(round=5, state="closed", joined=1, min_nodes=1, max_nodes=2,
                                  waited_s=2.0, timeout_left_s=28.0))
    assert f.description == "rendezvous round 5: nodes joined"
    assert f.status == "round closed without this node, next round; timeout 28s"


def test_plan_fields():
    f = bar_fields(PlanWait(nodes=1, min_nodes=2, waited_s=3.0, timeout_left_s=57.0))
    assert f == BarFields("plan", "first plan: nodes up", 1, 2, "need 2; timeout 57s")
    assert bar_fields(PlanWait(3, 2, 0.0, 1.0)).total == 3  # never more done than total


def test_switch_fields_pulse_without_acks_and_count_with_them():
    f = bar_fields(SwitchWait(to_version=4, from_version=3, phase="replan", acks_done=0,
                              acks_expected=None, waited_s=1.25))
    assert f == BarFields("switch", "switch v3 -> plan v4", 0, None,
                          "replan, waiting for switch-done")
    f = bar_fields(SwitchWait(4, None, "replan", 1, 2, 0.0))
    assert (f.description, f.completed, f.total) == ("switch ? -> plan v4: nodes acked", 1, 2)
    with pytest.raises(TypeError):
        bar_fields("rendezvous")  # type: ignore[arg-type]


def test_switch_tracker_follows_the_journal():
    t = SwitchTracker()
    t.observe(event(1, "replan", replan(1, 0)))  # the first plan: no switch
    assert t.wait(now=101.0) is None
    t.observe(event(2, "failure", change("failure", ["n:0"])))
    t.observe(event(3, "replan", replan(2, 1), at=110.0))
    w = t.wait(now=112.5)
    assert w == SwitchWait(2, 1, "replan", 0, None, 2.5)
    t.observe(event(4, "replan", replan(2, 1), at=111.0))  # the same switch: keeps its start
    assert t.wait(now=112.5).waited_s == 2.5
    t.observe(event(5, "replan", replan(3, 2), at=113.0))  # overtaken
    assert t.wait(now=114.0).to_version == 3
    t.observe(event(6, "switch-done", done(2)))  # the overtaken switch's end: not this one's
    assert t.wait(now=114.0).to_version == 3
    t.observe(event(7, "switch-done", done(3), timings={"total_s": 0.5}))
    assert t.wait(now=115.0) is None
    t.observe(event(8, "replan", replan(4, 3)))
    t.observe(event(9, "switch-failed", failed(4, "boom", 3)))
    assert t.current is None


@pytest.mark.timeout(60)
def test_elastic_waits_read_the_first_plan_wait_and_the_switch_from_the_job_view(etcd_server):
    """The bar reads the agent's job view, never etcd: each write below reaches it through the
    view's watches, and the test waits on the view's condition (no sleep)."""
    job = f"job-{uuid.uuid4().hex[:8]}"
    client = EtcdClient(etcd_server.endpoint_str, timeout=2.0)
    view = WatchedJob(client, job, name="bar")
    try:
        view.acquire((Table.NODES, Table.EVENTS, Table.HEAD, Table.SWITCH), 5.0)
        waits = ElasticWaits(view, min_nodes=2)

        def shows(want, *args, now=0.0):
            got = view.wait_for(lambda: waits.poll(*args, now=now) == want, 10.0)
            assert got, (waits.poll(*args, now=now), want)

        shows(PlanWait(0, 2, 1.0, 9.0), True, 1.0, 9.0)
        rec = schema.NodeRecord(host="h", agent_pid=1, devices=[], state="ready", started_at=0.0)
        client.put(schema.node_key(job, "a"), schema.encode(rec))
        shows(PlanWait(1, 2, 2.0, 8.0), True, 2.0, 8.0)
        append_event(client, job, "replan", "a", replan(1, 0))
        assert view.wait_for(lambda: view.events_after(0), 10.0)
        assert waits.poll(False, 3.0, 7.0, now=0.0) is None  # the first plan: no switch
        append_event(client, job, "replan", "a", replan(2, 1), wall_clock=lambda: 100.0)
        shows(SwitchWait(2, 1, "replan", 0, None, 1.0), False, 0.0, 0.0, now=101.0)
        ack = schema.SwitchAckRecord(node="a", plan_version=2, state="done", at=100.5)
        client.put(schema.switch_ack_key(job, 2, "a"), schema.encode(ack))
        shows(SwitchWait(2, 1, "replan", 1, None, 2.0), False, 0.0, 0.0, now=102.0)
        head = schema.PlanHeadRecord(version=2, created_at=0.0, store_endpoint="h:1", step=0,
                                     digest="sha256:0", devices=["a:0-1", "b:0"])
        client.put(schema.plan_head_key(job), schema.encode(head))  # the plan's 2 nodes
        shows(SwitchWait(2, 1, "replan", 1, 2, 2.0), False, 0.0, 0.0, now=102.0)
        append_event(client, job, "switch-done", "a", done(2, 1), {"total_s": 0.4})
        shows(None, False, 0.0, 0.0, now=103.0)
    finally:
        view.close()
        client.close()


# --------------------------------------------------------------------------------- drawing
def test_wait_bar_is_a_no_op_without_a_terminal():
    out = io.StringIO()
    bar = WaitBar(stream=out)
    assert not bar.enabled
    bar.update(PlanWait(1, 2, 0.0, 5.0))
    bar.clear()
    assert out.getvalue() == "" and bar.shown is None


def test_wait_bar_draws_one_bar_and_keeps_log_lines_above_it():
    import logging

    out = io.StringIO()
    handler = logging.StreamHandler(out)
    logger = logging.getLogger("launcher")
    logger.addHandler(handler)
    try:
        bar = WaitBar(stream=out, enabled=True)
        bar.update(RendezvousWait(0, "joining", 1, 2, 2, 0.5, 9.0))
        assert bar.shown == "rendezvous" and handler.stream is not out
        logging.getLogger("launcher.node.agent").warning("a log line while waiting")
        bar.update(SwitchWait(2, 1, "replan", 0, None, 0.0))  # another kind replaces the bar
        assert bar.shown == "switch"
        bar.update(None)
        assert bar.shown is None and handler.stream is out
    finally:
        logger.removeHandler(handler)
    text = out.getvalue()
    assert "rendezvous round 0: nodes joined" in text and "1/2" in text
    assert "a log line while waiting" in text and "switch v1 -> plan v2" in text


# ------------------------------------------------------------------ a real rendezvous wait
def _agent_args(etcd, job: str, node: str) -> list[str]:
    return ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "etcd",
            "--rdzv-endpoint", etcd.endpoint_str, "--rdzv-id", job, "--hspmd-node-id", node,
            "--rdzv-conf", "last_call_timeout=0.5,join_timeout=30", "--hspmd-lease-ttl", "2",
            "--shutdown-timeout", "5", str(SCRIPTS / "sleeper.py")]


class _PtyReader(threading.Thread):
    """Drains a pseudo-terminal's master side into ``text`` (bounded by ``deadline``)."""

    def __init__(self, fd: int, deadline: float):
        super().__init__(daemon=True)
        self.fd, self.deadline, self.chunks = fd, deadline, []
        self.lock = threading.Lock()

    @property
    def text(self) -> str:
        with self.lock:
            return b"".join(self.chunks).decode(errors="replace")

    def run(self) -> None:
        while time.monotonic() < self.deadline:
            ready, _, _ = select.select([self.fd], [], [], 0.1)
            if not ready:
                continue
            try:
                data = os.read(self.fd, 65536)
            except OSError:  # EIO: the agent exited and closed the terminal
                return
            if not data:
                return
            with self.lock:
                self.chunks.append(data)


@pytest.mark.multiproc
def test_agent_shows_a_progress_line_while_waiting_for_the_second_node(tmp_path, marker,
                                                                       etcd_server):
    job = f"job-{uuid.uuid4().hex[:8]}"
    pids = tmp_path / "pids"
    pids.mkdir()
    env = base_env(marker, PID_DIR=str(pids), EXIT_NOW="1", TERM="xterm")
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 200, 0, 0))
    reader = _PtyReader(master, time.monotonic() + 60)
    reader.start()
    out_a = open(tmp_path / "a.stdout", "wb")
    a = subprocess.Popen([LAUNCH, *_agent_args(etcd_server, job, "node-a")],
                         env=dict(env, PET_LOG_DIR=str(tmp_path / "a-logs")), stdout=out_a,
                         stderr=slave, stdin=subprocess.DEVNULL, cwd=str(REPO),
                         start_new_session=True)
    os.close(slave)
    b = None
    try:
        deadline = time.monotonic() + 20
        while "rendezvous round 0: nodes joined" not in reader.text:
            assert a.poll() is None, reader.text
            assert time.monotonic() < deadline, f"no progress line; terminal:\n{reader.text}"
            time.sleep(0.05)
        shown = reader.text
        assert "1/2" in shown and "need 2; timeout" in shown
        b = Launcher(_agent_args(etcd_server, job, "node-b"), env, tmp_path, "b")
        assert b.wait(60) == 0, b.stderr()
        assert a.wait(30) == 0, reader.text
    finally:
        if a.poll() is None:
            a.kill()
            a.wait(10)
        out_a.close()
        reader.join(5)
        os.close(master)
    terminal = reader.text
    assert "joined round 0" in terminal  # the log lines are still there, above the bar
    assert sorted(p.name for p in pids.iterdir()) == ["0.pids", "1.pids"]
    err_b = b.stderr()  # no terminal: log lines only, no bar, no control sequences
    assert "joined round 0" in err_b
    assert "nodes joined" not in err_b and "\x1b[" not in err_b


def test_wait_bar_gives_up_quietly_when_the_terminal_is_gone():
    class Gone(io.StringIO):
        def write(self, text):
            raise OSError(5, "Input/output error")

    bar = WaitBar(stream=Gone(), enabled=True)
    bar.update(PlanWait(1, 2, 0.0, 5.0))
    assert not bar.enabled and bar.shown is None
    bar.update(PlanWait(1, 2, 0.0, 5.0))  # a no-op from now on
    bar.clear()
