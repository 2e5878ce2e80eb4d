"""Vocabulary of ``launcher.ops``: errors, the status document's version, display constants.

Promises: every failure the ops commands report is an ``OpsError`` (coordination errors are
wrapped, chained with ``from``); the status document (``status --json``, ``/api/state``) carries
``"format": STATUS_FORMAT`` and ``"version": STATUS_VERSION``; a field is only ever added within
a version, never renamed or removed (docs/operations.md lists them).
"""

from __future__ import annotations

from hspmd_elastic.contract.env import ETCD_ENDPOINTS_ENV, JOB_ID_ENV

STATUS_FORMAT = "hspmd-job-status"
STATUS_VERSION = 1

ENV_ENDPOINTS = ETCD_ENDPOINTS_ENV  # the default of --etcd-endpoints (a worker has it)
ENV_JOB = JOB_ID_ENV  # the default of --job
DEFAULT_HOST = "127.0.0.1"

# Health of a device as the ops views show it: the verdict states plus what a verdict cannot say.
HEALTH_STATES = ("healthy", "degraded", "suspect", "failed", "unknown", "lost")
RECENT_EVENTS = 50  # events listed in a document (counters use the whole journal)
THROUGHPUT_SAMPLES = 600  # samples of the step-throughput chart kept by a cache


class OpsError(Exception):
    """Root of the errors of the ops commands; the message is one line for the operator."""


class EtcdUnreachableError(OpsError):
    """etcd could not be read (all endpoints down, or a deadline passed)."""


class JobNotFoundError(OpsError):
    """The job prefix holds no keys: wrong ``--job``, or the job has not started."""

    def __init__(self, job: str, prefix: str):
        self.job = job
        self.prefix = prefix
        super().__init__(f"job {job!r} has no keys under {prefix} (is the job id right?)")


class DashboardError(OpsError):
    """The dashboard could not start (e.g. the port is taken)."""
