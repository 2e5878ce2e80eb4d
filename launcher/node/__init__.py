"""The node agent: one per node, a thin shell that runs one of two modes.

A reader learns this package from ``api.py`` (the ``Mode`` protocol, ``AgentContext``,
``ModeOutcome``). Three rooms:

* what both modes use, here:

    launch.py     ``launch(config)``: etcd to serve or reach, signals, the agent, the exit code
    agent.py      ``NodeAgent``: the shell (signals, lease, log dir, progress bar) running a mode
    api.py        the ``Mode`` protocol, ``AgentContext``, ``ModeOutcome``, ``RoundInfo``
    outage.py     ``EtcdOutagePolicy``: how long workers run on while etcd is unreachable
    env.py        the worker environment of both modes (a contract with the workers)
    workers.py    worker processes: spawn in their own session, poll, TERM then KILL
    store.py      ``StoreServer``: the workers' TCPStore hosted by the agent
    hangs.py      ``ProgressMonitor``: progress heartbeats into the hang detector
    addresses.py  whether a host is this machine

* ``restart/``: restart mode (torchrun's semantics: rendezvous rounds, restarts);
* ``elastic/``: elastic mode (follow the leader's plans, never restart, end as one job).

Elastic mode never imports restart mode, nor restart mode elastic mode; the job-end record
both write is ``hspmd_elastic.contract.rounds``.

Nothing is imported here, so ``launcher.node.workers`` stays cheap to import.
"""
