"""Restart mode (torchrun's semantics): rendezvous rounds on etcd, restarts on any failure.

  mode.py        ``RestartMode``: one round after another, the worker group restarted whole
  rendezvous.py  the etcd rendezvous (rounds closed by one compare-and-set)
  health.py      the device health watch of a round (a failed GPU ends the round)

Nothing here is imported by elastic mode; the job-end record both modes write is the
contract's (``hspmd_elastic.contract.rounds``).
"""
