"""Elastic mode (``--hspmd-elastic``): follow the leader's plans, never restart, end as one job.

  mode.py     ``ElasticMode``: the mode the agent runs (first plan, ticks, the job's end)
  node.py     ``ElasticNode``: one elastic tick (plan, exits, hangs, verdicts, acks)
  workers.py  elastic workers: started only for slots a plan adds
  judge.py    the pure verdict on the job's end
  devices.py  the node's device table and node record
  exits.py    worker exits: journaled once, sticky slot verdicts of origin ``exit``
  acks.py     switch acks: how far this node got into a plan (pure)
  reach.py    the data-network probe of the plan's other nodes
  retry.py    a switch that failed with nothing to explain it: ask for the plan again

Elastic mode never imports restart mode (``launcher.node.restart``); the job-end record both
modes write is the contract's (``hspmd_elastic.contract.rounds``).
"""
