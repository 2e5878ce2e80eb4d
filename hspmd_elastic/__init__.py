"""Data plane of hspmd-elastic: annotations, plans, resharding, specialized graphs, worker runtime."""

from hspmd_elastic.heartbeats import heartbeat  # torch-free: one line opts a script into hang checks

__version__ = "0.1.0"
__all__ = ["heartbeat"]
