"""``launch(config)``: one ``hspmd-launch`` node from start to exit code.

It sets torchrun's ``OMP_NUM_THREADS`` default, starts the etcd this node serves (the embedded
one of ``--standalone``, or torchrun's c10d/static rendezvous store on the node at the endpoint
or node rank 0; ``launcher.standalone.AgentEtcd``), connects (c10d/static nodes wait up to
``STORE_WAIT_S`` for the serving node), runs the ``NodeAgent`` with the handled signals
installed, prints the one-line error, and on every path stops what it started: a node that
serves the store keeps it (at most ``LINGER_S``) until the other nodes left. The client uses the
``--hspmd-etcd-*`` TLS and auth settings (``config.etcd``); a refusal (handshake, password, no
permission on the job's prefix: read and write are both tried) is one line at once, never a
wait; the workers get the same settings through ``HSPMD_ETCD_*`` (``config.extra_env``).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import time
from dataclasses import replace
from typing import Any, Optional

from hspmd_elastic.contract import schema
from hspmd_elastic.coord.api import CoordinationError, EtcdAuthError
from hspmd_elastic.coord.client import EtcdClient, format_endpoint, parse_endpoints
from launcher.api import LaunchConfig, LaunchError, RendezvousConnectionError, SignalReceived
from launcher.node.agent import ETCD_TIMEOUT_S, NodeAgent
from launcher.node.addresses import advertised_address, is_local_address
from launcher.standalone import AgentEtcd, EtcdNotFoundError, EtcdStartError

log = logging.getLogger(__name__)

STORE_WAIT_S = 60.0  # c10d/static: how long a node waits for the serving node's etcd
LINGER_S = 30.0  # the serving node waits this long at most for the others to leave


def _install_signals(config: LaunchConfig, handler) -> dict[int, Any]:
    previous = {}
    for name in config.signals:
        signum = getattr(signal, name, None)
        if signum is None or signum in (signal.SIGKILL, signal.SIGSTOP):
            continue
        previous[signum] = signal.signal(signum, handler)
    return previous


def _omp_default(config: LaunchConfig) -> None:
    if "OMP_NUM_THREADS" not in os.environ and config.nproc_per_node > 1:
        log.warning("Setting OMP_NUM_THREADS environment variable for each process to be 1 in "
                    "default, to avoid your system being overloaded, please further tune the "
                    "variable for optimal performance in your application as needed.")
        os.environ["OMP_NUM_THREADS"] = "1"


def _serve_store(config: LaunchConfig) -> Optional[AgentEtcd]:
    """c10d/static: start the rendezvous etcd when this node is the one that serves it."""
    if not config.rdzv.host_etcd:
        return None
    host, port = parse_endpoints(config.rdzv.endpoints[0])[0]  # an IPv6 host without brackets
    if config.rdzv.backend == "c10d" and not is_local_address(host):
        return None
    hosted = AgentEtcd(host, int(port), tls=config.etcd_server, local_addr=config.local_addr)
    if not hosted.start():
        return None
    log.info("serving the rendezvous store (etcd) at %s for --rdzv-backend %s",
             format_endpoint(host, port), config.rdzv.backend)
    return hosted


def _connect(config: LaunchConfig, endpoints: tuple[str, ...], abort: list[int]) -> EtcdClient:
    """A client that reached etcd; c10d/static nodes wait for the serving node to come up."""
    security = config.etcd.with_tls() if config.etcd_server else config.etcd
    try:
        client = EtcdClient(list(endpoints), timeout=ETCD_TIMEOUT_S, security=security)
    except ValueError as exc:
        raise LaunchError(str(exc)) from exc
    patient = config.rdzv.backend in ("c10d", "static") and not config.rdzv.standalone
    deadline = time.monotonic() + (min(config.rdzv.join_timeout_s, STORE_WAIT_S) if patient
                                   else 0.0)
    waited = False
    while True:
        try:
            _check_access(client, config.rdzv.run_id)
            return client
        except EtcdAuthError as exc:
            client.close()
            raise LaunchError(str(exc)) from exc
        except CoordinationError as exc:
            if abort:
                client.close()
                raise SignalReceived(abort[0], signal.Signals(abort[0]).name) from exc
            if time.monotonic() >= deadline:
                client.close()
                hint = ""
                if patient:
                    hint = (f" (--rdzv-backend {config.rdzv.backend}: the node at the endpoint "
                            "serves an etcd there; is it up?)")
                raise RendezvousConnectionError(
                    f"cannot reach etcd at {','.join(endpoints)}: {exc}{hint}") from exc
            if not waited:
                log.info("waiting for the rendezvous store at %s", ",".join(endpoints))
            waited = True
            time.sleep(0.5)


def _check_access(client: EtcdClient, job: str) -> None:
    """etcd answers, and this client may read and write the job's prefix (with auth on, a
    denial now is one line instead of an outage later). The write deletes a key nobody writes:
    no revision, no event."""
    prefix = schema.job_prefix(job)
    client.revision(prefix=prefix)
    if client.security.uses_auth or client.security.cert_file:
        client.delete(prefix + "access-check")


def _linger(client: EtcdClient, config: LaunchConfig) -> None:
    """The node serving the store stays until the other nodes left (bounded)."""
    prefix = schema.nodes_prefix(config.rdzv.run_id)
    mine = schema.node_key(config.rdzv.run_id, config.node_id)
    deadline = time.monotonic() + LINGER_S
    while time.monotonic() < deadline:
        try:
            if not [kv for kv in client.get_prefix(prefix) if kv.key != mine]:
                return
        except CoordinationError:
            return
        time.sleep(0.1)
    log.warning("other nodes still registered after %.0fs; stopping the rendezvous store",
                LINGER_S)


def _preload_store() -> None:
    """Import torch's TCPStore now: both modes host one, and importing torch takes seconds on
    a busy host. Done before the lease exists, the import cannot starve its keep-alive, nor
    delay a rendezvous or a recovery that needs the store."""
    from torch.distributed import TCPStore  # torch  # noqa: F401


def launch(config: LaunchConfig) -> int:
    """Run one node agent to the end; returns torchrun's exit code. Raises LaunchError."""
    _omp_default(config)
    embedded = hosted = client = None
    pending: list[int] = []
    previous = _install_signals(config, lambda signum, _f: pending.append(signum))
    try:
        endpoints = config.rdzv.endpoints
        try:
            if config.rdzv.standalone:
                embedded = AgentEtcd(tls=config.etcd_server)
                embedded.start()
                endpoints = (embedded.endpoint,)
                log.info("standalone: embedded etcd at %s, --rdzv-id=%s", embedded.endpoint,
                         config.rdzv.run_id)
            hosted = _serve_store(config)
        except (EtcdNotFoundError, EtcdStartError) as exc:
            raise LaunchError(str(exc)) from exc
        client = _connect(config, endpoints, pending)
        _preload_store()  # after a refused connection fails fast, before the lease exists
        # the workers reach etcd as this agent does (elastic workers use it; see node/env.py)
        config = replace(config, extra_env={**client.security.to_env(), **config.extra_env})
        # --local-addr names this node to the others (its records, stores and workers' gloo);
        # the hostname may resolve to loopback or to another network's address: without it a
        # job that may span hosts advertises the address that reaches etcd (node/addresses.py)
        config = replace(config, local_addr=advertised_address(
            config.local_addr, socket.getfqdn(), config.rdzv.max_nodes, config.rdzv.standalone,
            parse_endpoints(client.current_endpoint)[0]))
        agent = NodeAgent(config, client, hostname=config.local_addr)
        _install_signals(config, agent.on_signal)
        for signum in pending:
            agent.on_signal(signum)
        code = agent.run()
        if agent.error_line:
            print(f"hspmd-launch: error: {agent.error_line}", file=sys.stderr, flush=True)
        return code
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)
        if hosted is not None and client is not None:
            _linger(client, config)
        if client is not None:
            client.close()
        if hosted is not None:
            hosted.stop()
        if embedded is not None:
            embedded.stop()
