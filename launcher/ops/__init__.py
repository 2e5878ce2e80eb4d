"""The operations surface of a job: ``status``, the live dashboard and Prometheus metrics.

Everything here reads the job's state from etcd and writes nothing back. Start with ``api.py``
(errors and the status document's version); then:

* ``view.py``: ``JobView``, a pure function of the job's (key, record) pairs -> what an operator
  sees (nodes, GPUs with health, plan layout, leader, throughput, events, switches, waits), and
  ``JobView.document()``, the stable JSON document of ``status --json`` and ``/api/state``;
* ``events.py``: the event journal read for operators: switches paired from events (with
  durations and bytes moved), counters, one-line summaries;
* ``state.py``: ``JobStateCache``, one ``PrefixWatch`` on the job prefix keeping a view current
  (list, then watch; full resync after a compaction), with change notification;
* ``status.py``: the rich terminal rendering of a view (tables, plan tree, progress bars);
* ``metrics.py``: a prometheus-client ``Collector`` over a cache (no global registry state);
* ``progress.py``: progress bars for long waits (a rendezvous collecting nodes, a switch);
* ``dashboard.py``: a stdlib HTTP server: ``/`` (one self-contained page, ``page.py``),
  ``/api/state``, ``/api/stream`` (Server-Sent Events on every change) and ``/metrics``;
  ``access.py``: whom it answers (the ``Host`` header, a bearer token);
* ``safe.py``: etcd strings on a terminal, as text (no markup, control characters escaped);
* ``commands.py``: the ``status`` and ``dashboard`` click commands
  (``python -m launcher.ops.commands status --job J``).

Usage::

    from hspmd_elastic.coord import EtcdClient
    from launcher.ops.state import JobStateCache, read_view

    with EtcdClient("127.0.0.1:2379") as client:
        print(read_view(client, "job1").document()["devices"]["counts"])
        with JobStateCache(client, "job1") as cache:
            version = cache.wait_changed(after=0, timeout=5.0)
            print(cache.view().plan)
"""
