"""The node agent: one per node, a thin shell that runs one of two modes.

A reader learns this package from ``api.py`` (the ``Mode`` protocol, ``AgentContext``,
``ModeOutcome``). The modules, by what they are:

  launch.py           ``launch(config)``: etcd to serve or reach, signals, the agent, the exit code
  agent.py            ``NodeAgent``: the shell (signals, lease, log dir, progress bar) running a mode
  outage.py           ``EtcdOutagePolicy``: how long workers run on while etcd is unreachable
  restart.py          ``RestartMode``: torchrun's semantics (rendezvous rounds, restarts)
  rendezvous.py       restart mode's etcd rendezvous (rounds closed by one compare-and-set)
  elastic.py          ``ElasticMode``: follow the leader's plans, never restart, end as one job
  judge.py            elastic mode's pure verdict on the job's end
  elastic_node.py     ``ElasticNode``: one elastic tick (plan, exits, hangs, verdicts, acks)
  elastic_workers.py  elastic workers: started only for slots a plan adds
  env.py              the worker environment of both modes (a contract with the workers)
  workers.py          worker processes: spawn in their own session, poll, TERM then KILL
  store.py            ``StoreServer``: the workers' TCPStore hosted by the agent
  devices.py          the node's device table and node record
  exits.py            worker exits: journaled once, sticky slot verdicts
  hangs.py            ``ProgressMonitor``: progress heartbeats into the hang detector
  acks.py             switch acks: how far this node got into a plan (pure)

Nothing is imported here, so ``launcher.node.workers`` stays cheap to import.
"""
