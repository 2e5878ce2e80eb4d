"""In-step strategy switching by length bucket: one optimizer step, each bucket under its plan.

A global batch grouped by length bucket (``bucket_data.BucketedDocuments``: bucket ``b``'s rows
are ``[start_b, start_b + rows_b)``, every document of ``b`` fits a window of ``window_b``
tokens) runs bucket by bucket, shortest first. Each bucket runs under its own ``Bucket.plan``
(the step's home plan's devices or some of them; its ``global_batch`` is the bucket's rows) with a
model whose ``seq_len`` is the bucket's window: short buckets pay for short sequences only, and
their plan may use other TP/PP/DP degrees than the home plan, whose layout holds the parameters
and the optimizer state.

Promises (``BucketedModel``, one per rank, wrapping the rank's home ``SpecializedModel``):

* ``step(batch, segments, real_tokens, before_update)`` equals the home model's ``step`` on the
  same global batch (float64: to rounding) and returns the same global loss: for each bucket, the
  home parameters move into the bucket's layout by one fused BSR (``reshard``), the bucket's
  gradients are computed and synchronised under the bucket's plan (``gradients``: each replica
  holds the sum), moved back into the home layout by a second fused BSR and summed; then the
  home model's ``update`` runs once. A bucket whose layout is the home plan's moves nothing (its
  model's parameters are the home parameters), and so does one the planner chose to run under
  the home layout because its switch would cost more than it saves
  (``planner.bucket_layouts``).
* The BSR schedules are made once per (home, bucket) pair when the model is built and reused
  every step (no planning on the step's path); bucket models with one layout share one set of
  process groups (``comms``).
* A bucket's plan may leave devices of the home plan out (a slow device idle for the short
  rows): those ranks send their parameters, compute nothing for the bucket, receive their
  gradients back, and the step's loss reaches them by one more all-reduce.
* A row of a bucket with a real token beyond the bucket's window, bucket rows that do not tile
  the global batch in order, windows that do not rise, a bucket plan over devices outside the
  home plan or a model it does not fit: one-line ``GraphError``/``PlanError`` naming the
  bucket. A step that fails in communication changes no state (the home update runs after
  every exchange).
* ``stats``: the last step's layout switches, their seconds and bytes (``BucketStats``);
  ``rows_needed()``: the span of global-batch rows this rank reads in any bucket.
* Process groups: ``create_comms`` makes each distinct non-home layout's groups; every rank of
  the default group must call it together, in the same order (as ``Comm.create``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable, Mapping, Optional, Sequence

import torch

from hspmd_elastic.graph.comm import Comm, GraphError, waiting
from hspmd_elastic.graph.config import ModelConfig, param_specs
from hspmd_elastic.graph.model import torch_dtype
from hspmd_elastic.graph.specialize import SpecializedModel, rank_rows
from hspmd_elastic.plan import Plan, PlanError
from hspmd_elastic.reshard import FusedSchedule, TensorSpec, fused_bsr_schedule
from hspmd_elastic.reshard.executor import execute_fused


@dataclass(frozen=True)
class Bucket:
    """Rows ``[start, start + plan.global_batch)`` of every global batch, run under ``plan``
    by a model whose ``seq_len`` is ``window``."""

    window: int
    start: int
    plan: Plan

    @property
    def rows(self) -> int:
        return self.plan.global_batch


@dataclass
class BucketStats:
    """One step's layout switches (each direction counts: parameters out, gradients back)."""

    switches: int = 0
    switch_s: float = 0.0
    bytes_moved: int = 0
    step_s: float = 0.0


def layout_key(plan: Plan) -> tuple:
    """What makes two plans hold parameters alike: pipelines of stages (devices, layers)."""
    return tuple(tuple((s.devices, s.layers) for s in p.stages) for p in plan.pipelines)


def check_buckets(home: Plan, buckets: Sequence[Bucket], config: ModelConfig) -> None:
    """The buckets tile ``home``'s global batch in order, shortest window first, over its
    devices, and each fits the model at its window (``Plan.check_model``)."""
    if not buckets:
        raise GraphError("no length buckets: need at least one")
    at, last = 0, 0
    for i, b in enumerate(buckets):
        if b.start != at:
            raise GraphError(f"bucket {i} starts at row {b.start}; the buckets before it end at "
                             f"row {at} (buckets must tile the global batch in order)")
        if not last < b.window <= config.seq_len:
            raise GraphError(f"bucket {i} window {b.window} must be above the previous "
                             f"bucket's ({last}) and at most seq_len={config.seq_len}")
        if not set(b.plan.devices) <= set(home.devices):
            raise PlanError(f"bucket {i} plan uses devices {list(b.plan.devices)}; the home "
                            f"plan's are {list(home.devices)}")
        b.plan.check_model(replace(config, seq_len=b.window))
        at, last = at + b.rows, b.window
    if at != home.global_batch:
        raise GraphError(f"the buckets hold {at} rows; the global batch has "
                         f"{home.global_batch}")


def create_comms(home: Plan, buckets: Sequence[Bucket], config: ModelConfig, rank: int,
                 create: Callable[[Plan, ModelConfig], Comm]) -> dict[tuple, Comm]:
    """The process groups of every distinct bucket layout other than the home plan's, made by
    ``create(plan, config)`` (``Comm.create`` with the caller's timeouts), in bucket order."""
    out: dict[tuple, Comm] = {}
    for b in buckets:
        key = layout_key(b.plan)
        if key != layout_key(home) and key not in out:
            out[key] = create(b.plan, replace(config, seq_len=b.window))
    return out


class BucketedModel:
    """A rank's home model and one model per length bucket (module doc)."""

    def __init__(self, home: SpecializedModel, buckets: Sequence[Bucket],
                 comms: Mapping[tuple, Comm], *, node_of: Optional[Mapping[int, str]] = None,
                 timeout_s: float = 60.0,
                 should_abort: Optional[Callable[[], bool]] = None,
                 comms_aborted: Optional[Callable[[], Optional[str]]] = None):
        check_buckets(home.plan, buckets, home.config)
        self.home, self.buckets, self.rank = home, tuple(buckets), home.rank
        self.timeout_s, self.should_abort = timeout_s, should_abort
        self.comms_aborted = comms_aborted  # execute_fused's: an aborted move is no move
        devices = home.plan.devices
        self._nodes = dict(node_of) if node_of is not None else {d: "node" for d in devices}
        self.models: list[Optional[SpecializedModel]] = []  # None: not in the bucket's plan
        self.moves: list[bool] = []
        self._schedules: list[tuple[Optional[FusedSchedule], Optional[FusedSchedule]]] = []
        home_key = layout_key(home.plan)
        specs = param_specs(home.config)
        home_ann = home.plan.param_annotations(home.config)
        dtype = torch_dtype(home.config)  # every parameter's, on every stage (ModelConfig.dtype)
        for i, b in enumerate(self.buckets):
            config = replace(home.config, seq_len=b.window)
            moves = layout_key(b.plan) != home_key
            comm = comms[layout_key(b.plan)] if moves else home.comm
            model = None
            if self.rank in b.plan.devices:
                model = SpecializedModel(config, b.plan, self.rank, comm, home.optimizer.config)
                model.optimizer.exp_avg, model.optimizer.exp_avg_sq = {}, {}  # never steps
            if moves:
                ann = b.plan.param_annotations(config)
                out = tuple(TensorSpec(n, specs[n].shape, dtype, home_ann[n], ann[n])
                            for n in sorted(specs))
                back = tuple(TensorSpec(n, s.shape, s.dtype, s.new, s.old) for n, s in
                             zip(sorted(specs), out))
                self._schedules.append((fused_bsr_schedule(out, devices, self._nodes),
                                        fused_bsr_schedule(back, b.plan.devices, self._nodes)))
            else:
                for n, p in model.params.items():
                    p.data = home.params[n].data  # the home parameters themselves
                self._schedules.append((None, None))
            self.models.append(model)
            self.moves.append(moves)
        self.stats = BucketStats()
        # a bucket over fewer devices: its loss reaches the others through one more all-reduce
        self._partial = any(b.plan.devices != devices for b in self.buckets)

    @property
    def plan(self) -> Plan:
        return self.home.plan

    def rows_needed(self) -> tuple[int, int]:
        """The rows ``[lo, hi)`` of the global batch this rank reads in any bucket (``lo ==
        hi``: none)."""
        spans = [(b.start + lo, b.start + hi) for b in self.buckets
                 if self.rank in b.plan.devices
                 for lo, hi in [rank_rows(b.plan, self.rank)] if hi > lo]
        if not spans:
            return 0, 0
        return min(s[0] for s in spans), max(s[1] for s in spans)

    # ---- the step ------------------------------------------------------------------------
    def step(self, batch: torch.Tensor, segments: torch.Tensor, real_tokens: int,
             before_update: Optional[Callable[[], None]] = None) -> float:
        """One optimizer step over the global batch (``batch``, ``segments``: the whole global
        batch, or the rows ``rows_needed()``); the global mean loss over ``real_tokens``."""
        began = time.perf_counter()
        first = self._first_row(batch)
        stats = BucketStats()
        total: Optional[dict[str, torch.Tensor]] = None
        loss = 0.0
        for i, b in enumerate(self.buckets):
            model = self.models[i]
            lo, hi = rank_rows(b.plan, self.rank) if model is not None else (0, 0)
            rows = slice(b.start + lo - first, b.start + hi - first) if hi > lo else slice(0, 0)
            tokens, segs = batch[rows], segments[rows]
            if hi > lo and segs.shape[1] > b.window + 1 and bool(
                    (segs[:, b.window + 1:] != 0).any()):
                row = b.start + lo + int((segs[:, b.window + 1:] != 0).any(dim=1).nonzero()[0])
                raise GraphError(f"row {row} of the global batch has a real token beyond bucket "
                                 f"{i}'s window of {b.window} (rows out of bucket order?)")
            if self.moves[i]:
                params = self._move(self._schedules[i][0], self.home.params, stats)
                if model is not None:
                    self._bind(model, params)
            grads, part = {}, 0.0  # a rank outside the bucket's plan gets its gradients back
            if model is not None:
                waited = model.comm.waited_s
                grads, part = model.gradients(tokens[:, :b.window + 1], segs[:, :b.window + 1],
                                              real_tokens)
                if model.comm is not self.home.comm:  # the runtime reads the home groups' waits
                    self.home.comm.waited_s += model.comm.waited_s - waited
                if self._partial and self.rank != min(b.plan.devices):
                    part = 0.0  # counted once, by the bucket's first device
            if self.moves[i]:
                grads = self._move(self._schedules[i][1], grads, stats)
            if total is None:
                total = grads
            else:
                for n, g in grads.items():
                    total[n].add_(g)
            loss += part
        if self._partial:
            loss = float(self.home.comm.all_reduce(
                torch.tensor([loss], dtype=torch.float64, device=self.home.device),
                self.home.plan.devices)[0])
        self.home.update(total, before_update)
        stats.step_s = time.perf_counter() - began
        self.stats = stats
        return loss

    def _first_row(self, batch: torch.Tensor) -> int:
        lo, hi = self.rows_needed()
        if batch.shape[0] == self.home.plan.global_batch:
            return 0
        if batch.shape[0] == hi - lo:
            return lo
        raise GraphError(f"batch of {batch.shape[0]} rows; expected the global batch "
                         f"({self.home.plan.global_batch}) or rows [{lo}, {hi})")

    def _move(self, schedule: FusedSchedule, tensors: Mapping[str, torch.Tensor],
              stats: BucketStats) -> dict[str, torch.Tensor]:
        t = time.perf_counter()
        local = {n: (v.data if isinstance(v, torch.nn.Parameter) else v)
                 for n, v in tensors.items()}
        with waiting():  # a device timer counts this as communication (elastic.device_timer)
            out, ex = execute_fused(schedule, self.rank, local, device=self.home.device,
                                    timeout_s=self.timeout_s, should_abort=self.should_abort,
                                    comms_aborted=self.comms_aborted)
        spent = time.perf_counter() - t
        self.home.comm.waited_s += spent  # communication: not this rank's compute
        stats.switches += 1
        stats.switch_s += spent
        stats.bytes_moved += ex.total_sent
        return out

    @staticmethod
    def _bind(model: SpecializedModel, params: Mapping[str, torch.Tensor]) -> None:
        for n, p in model.params.items():
            p.data = params[n]


def buckets_from(entries: Sequence[Mapping], devices: int) -> list[Bucket]:
    """A published plan's length buckets (``PlanRecord.buckets``: ``{"window", "start",
    "strategy"}`` each) over ids ``0..devices-1``; ``PlanError`` naming the bad entry."""
    out = []
    for i, entry in enumerate(entries):
        try:
            window, start = entry["window"], entry["start"]
            plan = Plan.from_dict(entry["strategy"])
        except (KeyError, TypeError) as exc:
            raise PlanError(f"length bucket {i}: {type(exc).__name__}: {exc}; expected "
                            "window, start and strategy") from None
        for what, v in (("window", window), ("start", start)):
            if isinstance(v, bool) or not isinstance(v, int) or v < (1 if what == "window" else 0):
                raise PlanError(f"length bucket {i}: {what}={v!r} is not a valid integer")
        if not set(plan.devices) <= set(range(devices)):
            raise PlanError(f"length bucket {i}: its plan uses device ids {list(plan.devices)}; "
                            f"the plan's {devices} devices have ids 0..{devices - 1}")
        out.append(Bucket(window, start, plan))
    return out


def check_sampler(buckets: Sequence[Bucket], sample: object) -> None:
    """The worker's sampler groups its global batches as the published buckets do (the same
    windows and rows: ``bucket_data.BucketedDocuments``); else a one-line ``GraphError``."""
    windows = tuple(b.window for b in buckets)
    rows = tuple(b.rows for b in buckets)
    got = (tuple(getattr(sample, "windows", ()) or ()), tuple(getattr(sample, "rows", ()) or ()))
    if got != (windows, rows):
        raise GraphError(f"the plan has length buckets of windows {list(windows)} and rows "
                         f"{list(rows)}, the script's data {list(got[0])} and {list(got[1])}: "
                         "give the script the same lengths as --hspmd-lengths (bucket_data."
                         "BucketedDocuments)")
