"""Live elasticity, worker side: the pieces ``runtime.py`` and ``switch.py`` are built from.

Modules:
  api.py         errors, the worker lifecycle (state machine), identity, progress, switch timings
  watchdog.py    the newest published plan (watch + re-read) and the abort-aware comm waiter
  group.py       forming a plan version's process group on its store (destroy + barrier + init)
  reaper.py      GroupReaper: dropping left groups off the main thread (abandoned collectives
                 still in flight on gloo; every group on NCCL)
  monitor.py     AbortMonitor: aborting a plan's communicators from a thread that is not stuck
  agree.py       pure decisions: resume step, owners, old-id -> new-rank mapping, BSR tensor list
  checkpoint.py  asynchronous sharded checkpoints, read back under any plan (the fallback)
"""
