"""Data plane of hspmd-elastic: annotations, plans, resharding, specialized graphs, worker runtime."""

__version__ = "0.1.0"
