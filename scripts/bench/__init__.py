"""The benchmarks behind ``scripts/bench_*``: one module per benchmark (``hetero``, ``varlen``,
``recovery``, ``mfu``) with the parts it keeps apart (``*_pure``: arguments, numbers and report
without processes; ``hetero_job``, ``hetero_mixes``, ``recovery_report``, ``recovery_setup``),
the training scripts their jobs run (``elastic_train``, ``restart_train``,
``sharded_restart_train``, with ``timeline``), and ``common``: what several share. Imported with
``scripts/`` on ``sys.path`` (the ``scripts/bench_*`` commands put it there)."""
