"""The node agent of ``hspmd-launch``: a thin shell that runs one mode to the end.

One agent runs per node. The shell owns what both modes share: the handled signals, the node's
etcd lease (``LeasedSession``), the run's log directory, the progress bar, and the etcd-outage
policy (``EtcdOutagePolicy``). It hands them to its mode through an ``AgentContext`` and runs the
mode through the ``launcher.node.api.Mode`` protocol: restart mode (``RestartMode``, torchrun's
semantics) by default, elastic mode (``ElasticMode``) with ``--hspmd-elastic``. Promises:

* before its mode starts, the agent claims its node id (``launcher.node.claim``): a second
  agent with the same ``--hspmd-node-id``, or one whose mode is not the job's, fails in one
  line and leaves the running job alone;
* a handled signal (SIGTERM, SIGINT, SIGHUP, SIGQUIT by default) ends every wait; the mode
  forwards it to the workers, which get ``--shutdown-timeout`` seconds before SIGKILL (a second
  signal cuts that short); the agent
  then leaves the job and exits 1, like torchrun;
* a ``LaunchError`` (or etcd lost for longer than the outage policy allows) stops the mode with
  that one line, which ``launch`` prints after ``hspmd-launch: error:``;
* on every exit path the mode's workers are stopped and reaped and the lease is revoked, so the
  node's leased records vanish at once; every process the agent starts dies with it, even on
  SIGKILL (``launcher.node.workers.die_with_parent``);
* while a mode waits (a rendezvous, the first plan, a switch), an agent whose stderr is a
  terminal shows one progress bar there (``launcher.console``); without a terminal it writes
  only its log lines.
"""

from __future__ import annotations

import logging
import signal
import socket
import time
from typing import Callable, Optional

from hspmd_elastic.coord.api import CoordinationError
from hspmd_elastic.coord.client import EtcdClient
from hspmd_elastic.coord.lease import LeasedSession
from launcher.api import EXIT_FAILED, EXIT_OK, LaunchConfig, LaunchError, SignalReceived
from launcher.cgroup_memory import release_memory
from launcher.cgroup_sweep import release as release_cgroups
from launcher.console import WaitBar
from launcher.logs import RunLogDir
from launcher.node.api import AgentContext, Mode, ModeOutcome, StopCause
from launcher.node.claim import claim_node
from launcher.node.outage import EtcdOutagePolicy

log = logging.getLogger(__name__)

ETCD_TIMEOUT_S = 5.0  # the deadline of every etcd call the agent makes


class NodeAgent:
    """Runs one node's mode until the job ends or a signal arrives (see the module docstring)."""

    def __init__(self, config: LaunchConfig, client: EtcdClient,
                 clock: Callable[[], float] = time.monotonic, hostname: Optional[str] = None):
        self.config = config
        host = hostname or socket.getfqdn()
        session = LeasedSession(client, ttl=config.rdzv.lease_ttl_s,
                                name=f"agent-{config.node_id}")
        outage = EtcdOutagePolicy(config.rdzv.lease_ttl_s, config.rdzv.etcd_outage_limit_s,
                                  label=f"[{config.rdzv.run_id}] node {config.node_id}: ",
                                  clock=clock)
        self.ctx = AgentContext(config, client, session, host,
                                RunLogDir(config.logs, config.rdzv.run_id), WaitBar(), outage,
                                clock=clock)
        self.outcome: Optional[ModeOutcome] = None

    @property
    def error_line(self) -> str:
        """The one line to print after ``hspmd-launch: error:`` ("" when none)."""
        return self.outcome.error_line if self.outcome is not None else ""

    def on_signal(self, signum: int, _frame=None) -> None:
        self.ctx.signal(signum)

    def make_mode(self) -> Mode:
        if self.config.elastic is not None:
            from launcher.node.elastic.mode import ElasticMode  # startup: the leader, the planner

            return ElasticMode(self.ctx)
        from launcher.node.restart.mode import RestartMode  # startup

        return RestartMode(self.ctx)

    def run(self) -> int:
        """Run the mode to its end; returns the exit code (torchrun's: 0 or 1)."""
        ctx = self.ctx
        try:  # before anything else of the job is written: one owner per node id, one mode
            claim_node(ctx, timeout=ETCD_TIMEOUT_S)
        except (LaunchError, CoordinationError) as exc:
            cause = (StopCause(signum=ctx.signum or signal.SIGTERM)
                     if isinstance(exc, SignalReceived) else
                     StopCause(error=f"etcd: {exc}" if isinstance(exc, CoordinationError)
                               else str(exc)))
            self.outcome = cause.outcome()
            self._leave()
            return EXIT_FAILED
        mode = self.make_mode()
        cause: Optional[StopCause] = None
        try:
            mode.start()
            while True:
                ctx.check_abort()
                if mode.tick() is not None:
                    break
        except SignalReceived:
            cause = StopCause(signum=ctx.signum or signal.SIGTERM)
        except CoordinationError as exc:
            cause = StopCause(error=f"etcd: {exc}")
        except LaunchError as exc:
            cause = StopCause(error=str(exc))
        try:
            self.outcome = mode.stop(cause)
        finally:
            self._leave()
            release_cgroups(ctx.job)  # this host's CPU cgroups of the job, a dead owner's too
            release_memory(ctx.job)  # and its memory cgroups (--hspmd-enforce-memory)
        return EXIT_OK if self.outcome.ok else EXIT_FAILED

    def _leave(self) -> None:
        """Revoke the lease: the node's leased records vanish now, not after the TTL."""
        self.ctx.bar.clear()
        try:
            self.ctx.session.stop(revoke=True, timeout=ETCD_TIMEOUT_S)
        except CoordinationError as exc:
            log.warning("[%s] node %s: leaving etcd: %s", self.ctx.job, self.ctx.node_id, exc)
