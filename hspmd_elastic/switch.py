"""Graph switching: from whatever this process holds to the specialized graph of a new plan,
without restarting the process or reading a checkpoint when the state survives in memory.

``GraphSwitch.switch(record, held)`` runs the switch of ARCHITECTURE.md on one rank:

1. regroup: leave the old process group, meet the plan's ranks on its store, form the new group;
2. exchange: one all-gather of every rank's ``Holding`` (state version, step, undo step, newest
   checkpoint); ``agree.decide`` turns it into the resume step and the owners (see agree.py for
   the step-consistency argument and the one-step rollback);
3. reshard: old device ids map to new ranks through the device id strings, dead devices are not
   owners; one fused BSR moves parameters, AdamW moments and the step counter (the data cursor:
   step ``s`` reads global samples ``[s*B, (s+1)*B)``; the model has no random state);
4. rebuild: the new ``SpecializedModel`` binds the received shards, its communication waits
   through the runtime's watchdog.

Draining (``record.drain``): a device that leaves the plan while it still works (a suspect GPU)
joins the switch's group after the plan's ranks (rank ``len(devices) + i``). It takes part in the
regroup, the exchange and the BSR as an owner, and in the creation of the plan's sub-groups (every
rank of the default group must), but it receives nothing and builds no model: its state leaves
by network, then its worker leaves (``SwitchResult.drained``).

Nobody holds state (the first plan, or every worker restarted): the newest complete checkpoint
is read if there is one, else each rank reads its own slices of the Hugging Face checkpoint
``init_from`` when one is given (``hf.initial_state_from_hf``), else weights come from the seed;
the last two only while the job has not trained (``PlanRecord.step`` 0); after that it is
``UnrecoverableStateError``, never a silent restart. So ``init_from`` is read by the job's first
switch only: later switches get the state from the survivors or from a newer checkpoint. A slice with no live owner raises
``ReshardError`` on every rank alike (planning is pure); the switch then reads the newest
checkpoint every rank sees, saying why, or raises ``UnrecoverableStateError`` naming the slices.
It never trains on wrong weights. A newer plan or a failed communication during the switch
raises ``SwitchRequested`` / ``CommTimeoutError`` / ``RegroupAborted``, and the caller starts
over from the newest plan: nothing this rank holds is modified before the switch completes.

Every wait of the switch sees a newer plan: the store barrier of the regroup, the exchange (the
watchdog), the BSR's transfers (``should_abort``: ``ReshardAborted``) and the creation of the
plan's sub-groups (a polled barrier on the version's store first: ``CommAborted``; on NCCL their
first operation too, where the communicators become ready: ``GroupFormer.ready``), so a peer
that leaves the switch, dead or gone to a newer plan, costs the others at most the time until
that plan is published. The abort monitor is armed over the exchange and the BSR, never over
the creation of communicators (an abort then waits for it). On NCCL a transfer or collective
that completed only because the monitor aborted the communicators fails the switch
(``ReshardCommError``, ``CommTimeoutError``). Limits: a peer that dies inside gloo's connection
of the sub-groups, after the barrier, is waited for up to ``comm_s``. A switch that fails after some ranks
committed it leaves the state in two layouts; the next switch reads from both (see agree.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from hspmd_elastic.coord import EtcdClient, append_event
from hspmd_elastic.contract import schema
from hspmd_elastic.contract.ids import node_of
from hspmd_elastic.coord.api import CoordinationError
from hspmd_elastic.coord.contract import plan_of
from hspmd_elastic.elastic import agree
from hspmd_elastic.elastic.api import (ConfigurationError, SwitchError, SwitchTimings,
                                       UnrecoverableStateError, WorkerIdentity)
from hspmd_elastic.elastic.checkpoint import CheckpointWriter, latest_complete, load_shards
from hspmd_elastic.elastic.group import GroupFormer
from hspmd_elastic.elastic.watchdog import PlanWatcher, Watchdog
from hspmd_elastic.graph.bucketed import BucketedModel, buckets_from, create_comms
from hspmd_elastic.graph.comm import Comm, CommTimeoutError
from hspmd_elastic.graph.config import ModelConfig
from hspmd_elastic.graph.optim import AdamWConfig
from hspmd_elastic.graph.specialize import SpecializedModel
from hspmd_elastic.hf import initial_state_from_hf
from hspmd_elastic.plan import Plan
from hspmd_elastic.reshard import ReshardError, fused_bsr_schedule
from hspmd_elastic.reshard.executor import execute_fused

log = logging.getLogger(__name__)



UNDO_MODES = ("device", "host", "off")


@dataclass
class Held:
    """What a rank holds between switches: its plan, its model and a one-step undo copy.

    ``undo_mode`` says where the undo copy lives (``UNDO_MODES``): ``"device"`` (the default) on
    the model's device (``model.device``), ``"host"`` in host memory (pinned when the model is on
    CUDA; copied asynchronously, waited for only when the copy is read), ``"off"``: none. The
    copy costs one more set of the state tensors: parameters and both AdamW moments, 3 x the
    dtype's bytes per parameter (12 B in float32) on the device or on the host. Without it, a
    rank one step ahead in a switch cannot present the resume step: it is no owner, and a slice
    nobody else holds falls back to a checkpoint or fails naming the missing undo copy (see
    ``GraphSwitch._fallback``), never a different state.

    ``train_step`` keeps the undo copy cheaply: the state is copied once the step's
    communication succeeded (a failed step copies nothing), into the same buffers every step
    (no allocation; live state plus one copy in memory). The copy itself, parameters and both
    AdamW moments, stays: about one optimizer update's worth of memory traffic per step
    (``"host"``: that much over the host link instead).
    ``snapshot`` + ``commit`` is the allocating form of the same (a fresh copy per step).
    """

    version: int
    plan: Plan
    devices: list[str]
    model: SpecializedModel
    undo: Optional[tuple[int, dict[str, torch.Tensor]]] = None
    undo_mode: str = "device"
    _undo_ready: Optional[object] = None  # CUDA event: the host copy has landed
    # length buckets (PlanRecord.buckets): the step runs each bucket under its plan
    bucketed: Optional[BucketedModel] = None

    def __post_init__(self) -> None:
        if self.undo_mode not in UNDO_MODES:
            raise ConfigurationError(f"undo={self.undo_mode!r}; valid: "
                                     f"{', '.join(repr(m) for m in UNDO_MODES)}")

    @property
    def step(self) -> int:
        return int(self.model.optimizer.step_count)

    @property
    def _on_host(self) -> bool:
        return self.undo_mode == "host" and self.model.device.type != "cpu"

    def _copy(self, t: torch.Tensor) -> torch.Tensor:
        if not self._on_host:
            return t.detach().clone()
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=self.model.device.type == "cuda")
        return out.copy_(t.detach())

    def snapshot(self) -> tuple[int, dict[str, torch.Tensor]]:
        """A copy of the state at the current step; it becomes ``undo`` once the step that
        follows completes (``commit``), so a failed step keeps the previous undo copy."""
        return (self.step, {n: self._copy(t)
                            for n, (t, _ann) in self.model.state_tensors().items()})

    def commit(self, snapshot: tuple[int, dict[str, torch.Tensor]]) -> None:
        self.undo = snapshot

    def train_step(self, batch: torch.Tensor, segments: Optional[torch.Tensor] = None,
                   real_tokens: Optional[int] = None) -> float:
        """One training step (``segments``, ``real_tokens``: packed documents, see
        ``SpecializedModel.step``); the undo copy becomes the state before it once it
        commits."""
        keep = None if self.undo_mode == "off" else self._keep_undo
        if self.bucketed is not None:
            return self.bucketed.step(batch, segments, real_tokens, before_update=keep)
        return self.model.step(batch, before_update=keep, segments=segments,
                               real_tokens=real_tokens)

    def batch_rows(self) -> tuple[int, int]:
        """The rows of each global batch this rank reads (in any length bucket)."""
        return self.bucketed.rows_needed() if self.bucketed is not None \
            else self.model.batch_rows()

    def comms(self) -> list[Comm]:
        """Every set of process groups this rank holds: the plan's, then the buckets'."""
        extra = [m.comm for m in self.bucketed.models if m is not None] \
            if self.bucketed is not None else []  # None: a bucket whose plan leaves us out
        out: list[Comm] = [self.model.comm]
        for c in extra:
            if all(c is not o for o in out):
                out.append(c)
        return out

    @torch.no_grad()
    def _keep_undo(self) -> None:
        step, live = self.step, self.model.state_tensors()
        buffers = self.undo[1] if self.undo is not None else None
        if buffers is None or buffers.keys() != live.keys() or any(
                buffers[n].shape != t.shape for n, (t, _ann) in live.items()):
            self.undo = self.snapshot()
            return
        host = self._on_host
        for name, (tensor, _ann) in live.items():
            buffers[name].copy_(tensor, non_blocking=host)
        if host and self.model.device.type == "cuda":
            # the update that follows is ordered after the copy on the stream; a reader of the
            # host buffers waits for this event (``tensors_at``)
            self._undo_ready = torch.cuda.Event()
            self._undo_ready.record()
        self.undo = (step, buffers)

    def tensors_at(self, step: int) -> dict[str, torch.Tensor]:
        if self.step == step:
            return {n: t for n, (t, _ann) in self.model.state_tensors().items()}
        if self.undo is not None and self.undo[0] == step:
            if self._undo_ready is not None:
                self._undo_ready.synchronize()
            return self.undo[1]
        kept = (f"{self.undo[0] if self.undo else None}" if self.undo_mode != "off"
                else "none (the undo copy is off)")
        raise SwitchError(f"rank holds step {self.step} and undo step {kept}, not {step}")


@dataclass(frozen=True)
class SwitchTimeouts:
    regroup_s: float = 60.0  # meeting the plan's ranks on the store
    comm_s: float = 60.0  # each collective / point-to-point wait, the BSR, group creation
    checkpoint_flush_s: float = 30.0


@dataclass
class SwitchResult:
    held: Optional[Held]  # None when this rank drained (it holds nothing afterwards)
    rank: int
    resume_step: int
    timings: SwitchTimings

    @property
    def drained(self) -> bool:
        return self.held is None


def switch_group(record: schema.PlanRecord) -> list[str]:
    """The devices of a switch's process group: the plan's ranks, then the drained devices."""
    return list(record.devices) + [d for d in record.drain if d not in record.devices]


class GraphSwitch:
    """Switches one worker between plans (see the module docstring)."""

    def __init__(self, identity: WorkerIdentity, client: EtcdClient, plans: PlanWatcher,
                 former: GroupFormer, watchdog: Watchdog, config: ModelConfig,
                 optim: AdamWConfig, seed: int, timeouts: SwitchTimeouts,
                 checkpoints: Optional[CheckpointWriter] = None,
                 checkpoint_dir: Optional[str] = None,
                 wall_clock: Callable[[], float] = time.time, undo: str = "device",
                 init_from: Optional[str] = None):
        if undo not in UNDO_MODES:
            raise ConfigurationError(f"undo={undo!r}; valid: "
                                     f"{', '.join(repr(m) for m in UNDO_MODES)}")
        self.undo = undo
        self.identity, self.client, self.plans = identity, client, plans
        self.former, self.watchdog = former, watchdog
        self.config, self.optim, self.seed, self.timeouts = config, optim, seed, timeouts
        self.checkpoints, self.checkpoint_dir = checkpoints, checkpoint_dir
        self.init_from = init_from  # a Hugging Face checkpoint directory: the job's start
        self._wall = wall_clock

    # ------------------------------------------------------------------------ the switch
    def switch(self, record: schema.PlanRecord, held: Optional[Held],
               stalled_since: Optional[float] = None,
               on_phase: Callable[[str], None] = lambda phase: None) -> SwitchResult:
        start = time.monotonic()
        group = switch_group(record)
        rank = group.index(self.identity.device)
        draining = rank >= len(record.devices)
        plan = plan_of(record)
        plan.check_model(self.config)
        timings = SwitchTimings(held.version if held else 0, record.version, rank)
        seen = self.plans.seen_at(record.version)
        if seen is not None:
            timings.detect_s = max(0.0, seen - record.created_at)
            if stalled_since is not None:  # first failed wait -> plan seen (on one clock)
                seen_monotonic = time.monotonic() - (self._wall() - seen)
                timings.stall_s = max(0.0, seen_monotonic - stalled_since)
        mine = self._holding(held)  # flushes pending checkpoint writes first

        on_phase("regrouping")
        t = time.monotonic()
        self.former.form(record.version, record.store_endpoint, rank, len(group),
                         aborted=self._superseded(record.version),
                         deadline=t + self.timeouts.regroup_s)
        timings.regroup_s = time.monotonic() - t

        # armed over the waits on the device (the exchange, the BSR), never over the creation
        # of communicators: an abort then waits for the creation (GroupFormer.ready bounds it)
        with self.former.armed(f"switch to plan v{record.version}", self.timeouts.comm_s,
                               self._superseded(record.version)):
            state, resume = self._move_state(record, held, group, rank, plan, mine, timings,
                                              on_phase)
        on_phase("building")
        t = time.monotonic()
        buckets = buckets_from(record.buckets, len(record.devices))
        comm, bucket_comms = self._create_comms(record, plan, buckets, rank)
        if draining:
            timings.resume_step = resume
            timings.total_s = time.monotonic() - start
            self._report(record, rank, timings, drained=True)
            return SwitchResult(None, rank, resume, timings)
        model = SpecializedModel.build(self.config, plan, rank, seed=self.seed, state=state,
                                       comm=comm, optim=self.optim)
        bucketed = None
        if buckets:
            bucketed = BucketedModel(model, buckets, bucket_comms,
                                     node_of={i: node_of(d) for i, d in enumerate(record.devices)},
                                     timeout_s=self.timeouts.comm_s,
                                     should_abort=self._superseded(record.version),
                                     comms_aborted=self.former.comms_aborted)
        timings.rebuild_s = time.monotonic() - t
        if int(model.optimizer.step_count) != resume:
            raise SwitchError(f"plan v{record.version} rank {rank}: rebuilt state is at step "
                              f"{int(model.optimizer.step_count)}, agreed {resume}")
        timings.resume_step = resume
        timings.total_s = time.monotonic() - start
        self._report(record, rank, timings)
        return SwitchResult(Held(record.version, plan, list(record.devices), model,
                                 undo_mode=self.undo, bucketed=bucketed), rank, resume, timings)

    def _move_state(self, record, held, group, rank, plan, mine, timings, on_phase):
        """The exchange of holdings and the BSR: this rank's new state and the step it is at."""
        on_phase("exchanging")
        t = time.monotonic()
        holdings = self._exchange(mine, len(group))
        decision = agree.decide(holdings)
        timings.exchange_s = time.monotonic() - t

        on_phase("resharding")
        t = time.monotonic()
        state, resume = self._state(record, group, plan, rank, held, holdings, decision,
                                    timings)
        timings.bsr_s = time.monotonic() - t
        return state, resume

    def _create_comms(self, record, plan, buckets, rank):
        """The plan's process groups (and each bucket layout's), their communicators ready
        (``GroupFormer.ready``: bounded, watching for newer plans)."""
        superseded = self._superseded(record.version)
        deadline = time.monotonic() + self.timeouts.regroup_s
        try:
            comm = Comm.create(plan, self.config, rank, timeout_s=self.timeouts.comm_s,
                               waiter=self.watchdog, store=self.former.store,
                               aborted=superseded, device=self.former.device,
                               group_timeout_s=self.former.group_timeout_s)
            bucket_comms = create_comms(plan, buckets, self.config, rank, lambda p, c: Comm.create(
                p, c, rank, timeout_s=self.timeouts.comm_s, waiter=self.watchdog,
                device=self.former.device, group_timeout_s=self.former.group_timeout_s))
        except CommTimeoutError:
            raise
        except RuntimeError as exc:  # a peer left the switch: creating sub-groups timed out
            raise CommTimeoutError(f"plan v{record.version}: creating the process groups "
                                   f"failed: {str(exc).splitlines()[0][:200]}") from exc
        groups = [g for c in (comm, *bucket_comms.values()) for g in c.groups.values()]
        self.former.ready(groups, f"plan v{record.version}'s groups", superseded, deadline)
        return comm, bucket_comms

    def _superseded(self, version: int) -> Callable[[], bool]:
        """True once a plan newer than ``version`` is known (a lock-only check)."""
        return lambda: self.plans.newer_than(version) is not None

    # ------------------------------------------------------------------------ exchange
    def _holding(self, held: Optional[Held]) -> agree.Holding:
        if self.checkpoints is not None and not self.checkpoints.flush(
                self.timeouts.checkpoint_flush_s):
            log.warning("checkpoint writes still pending after %.0fs",
                        self.timeouts.checkpoint_flush_s)
        ckpt = latest_complete(self.checkpoint_dir)
        if held is None:
            return agree.Holding(checkpoint_step=ckpt)
        undo = held.undo[0] if held.undo is not None else agree.NO_STEP
        return agree.Holding(held.version, held.step, undo, ckpt)

    def _exchange(self, mine: agree.Holding, world: int) -> list[agree.Holding]:
        values = torch.tensor(mine.encode(), dtype=torch.int64)
        out = [torch.empty_like(values) for _ in range(world)]
        what = "switch exchange all_gather"
        self.watchdog(Comm.post(lambda: dist.all_gather(out, values, async_op=True), what), what)
        return [agree.Holding.decode(v.tolist()) for v in out]

    # ------------------------------------------------------------------------ state
    def _state(self, record, group, plan, rank, held, holdings, decision, timings):
        """This rank's new local state tensors (None: initialise from the seed) and its step;
        a drained rank only sends (it gets None). ``timings.source``: ``bsr``, ``checkpoint``,
        ``hf`` (the ``init_from`` checkpoint) or ``init`` (the seed)."""
        draining = rank >= len(record.devices)
        if decision.fresh and draining:
            return None, decision.resume_step
        if decision.fresh:
            ckpt = agree.checkpoint_step(holdings)
            if ckpt >= 0:
                timings.source = "checkpoint"
                log.info("plan v%d rank %d: nobody holds state; resuming from the checkpoint "
                         "of step %d", record.version, rank, ckpt)
                return self._read_checkpoint(ckpt, plan, rank, timings), ckpt
            if record.step > 0:  # the job trained: starting from the seed would lose that
                why = (f"nobody in plan v{record.version} holds the training state (the job "
                       f"had reached step {record.step}) and no checkpoint every rank sees "
                       "exists")
                self._event("switch-failed", rank, record, schema.SwitchFailedDetail(
                    record.version, why, "", timings.from_version))
                raise UnrecoverableStateError(f"{why}, so the job cannot continue")
            if self.init_from is not None:
                return self._read_init_from(record, plan, rank, timings), 0
            timings.source = "init"
            return None, 0
        sources = []
        for version in sorted({holdings[r].version for r in decision.owners}):
            old = self._old_record(version, held)
            sources.append(agree.Source(version, plan_of(old), tuple(old.devices)))
        specs, nodes = agree.reshard_request(self.config, sources, holdings, decision.owners,
                                             group, plan)
        try:
            schedule = fused_bsr_schedule(specs, decision.owners, nodes)
        except ReshardError as exc:
            if draining:  # the plan's ranks fall back; this rank has nothing to send
                log.warning("plan v%d drained rank %d: %s", record.version, rank, exc)
                return None, decision.resume_step
            return self._fallback(record, plan, rank, holdings, exc, timings,
                                  decision.resume_step)
        local = held.tensors_at(decision.resume_step) if rank in decision.owners else {}
        timings.rolled_back = rank in decision.rollback
        received, stats = execute_fused(schedule, rank, local, device=self.former.device,
                                        timeout_s=self.timeouts.comm_s,
                                        should_abort=self._superseded(record.version),
                                        comms_aborted=self.former.comms_aborted)
        totals = schedule.link_stats()
        timings.bsr_bytes_total = totals.total_bytes
        timings.bsr_bytes_sent = stats.total_sent
        timings.bsr_bytes_received = stats.total_received
        return (None if draining else received), decision.resume_step

    def _old_record(self, version: int, held: Optional[Held]) -> schema.PlanRecord:
        if held is not None and held.version == version:
            return schema.PlanRecord(version=version, reason="held", devices=held.devices,
                                     strategy=held.plan.to_dict(), store_endpoint="",
                                     created_at=0.0)
        key = schema.plan_history_key(self.identity.job, version)
        kv = self.client.get(key)
        if kv is None:
            raise SwitchError(f"plan v{version}, whose state the survivors hold, is missing "
                              f"from etcd ({key})")
        return schema.decode(key, kv.value)

    def _read_checkpoint(self, step: int, plan, rank: int, timings) -> dict:
        """This rank's own slices from checkpoint ``step`` (only those are read); the bytes
        read go to ``timings.extra["checkpoint_bytes_read"]``."""
        stats: dict = {}
        state = load_shards(self.checkpoint_dir, step, self.config, plan, rank, stats)
        timings.extra["checkpoint_bytes_read"] = stats.get("bytes_read", 0)
        return state

    def _read_init_from(self, record, plan, rank: int, timings) -> dict:
        """This rank's own slices of the Hugging Face checkpoint ``init_from``, zero AdamW
        moments and step 0; the bytes read go to ``timings.extra["checkpoint_bytes_read"]``."""
        stats: dict = {}
        state = initial_state_from_hf(self.init_from, self.config, plan, rank, stats)
        timings.source = "hf"
        timings.extra["checkpoint_bytes_read"] = stats.get("bytes_read", 0)
        log.info("plan v%d rank %d: nobody holds state; starting from the Hugging Face "
                 "checkpoint %s (%d B read: this rank's slices)", record.version, rank,
                 self.init_from, timings.extra["checkpoint_bytes_read"])
        return state

    def _fallback(self, record, plan, rank, holdings, exc: ReshardError, timings,
                  held_step: int):
        """Some slice has no live owner: the whole job goes back to the newest checkpoint
        every rank sees, every slice from that step (no survivor's newer state is mixed in)."""
        ckpt = agree.checkpoint_step(holdings) if self.checkpoint_dir else agree.NO_STEP
        undo = _missing_undo(holdings, held_step)
        lost = f"{undo}: {exc}" if undo else str(exc)
        if ckpt < 0:
            why = ("no checkpoint directory is configured" if not self.checkpoint_dir
                   else f"no complete checkpoint in {self.checkpoint_dir}")
            self._event("switch-failed", rank, record, schema.SwitchFailedDetail(
                record.version, lost, why, timings.from_version))
            raise UnrecoverableStateError(
                f"plan v{record.version}: {lost}; {why}, so the job cannot continue") from exc
        timings.source = "checkpoint"
        redone = max(held_step - ckpt, 0)
        why = lost.splitlines()[0]
        log.warning("plan v%d rank %d: back to the checkpoint of step %d, %d step(s) redone: %s",
                    record.version, rank, ckpt, redone, why)
        state = self._read_checkpoint(ckpt, plan, rank, timings)
        log.info("plan v%d rank %d: read %d B of checkpoint step %d (its own slices)",
                 record.version, rank, timings.extra["checkpoint_bytes_read"], ckpt)
        self._event("fallback", rank, record, schema.FallbackDetail(record.version, lost, ckpt,
                                                                    redone))
        return state, ckpt

    # ------------------------------------------------------------------------ reporting
    def _report(self, record, rank, timings: SwitchTimings, drained: bool = False) -> None:
        if drained:
            log.info("drain v%d->v%d rank %d (%s): resume_step=%d regroup=%.3fs exchange=%.3fs "
                     "bsr=%.3fs (%d B sent) total=%.3fs", timings.from_version,
                     timings.to_version, rank, self.identity.device, timings.resume_step,
                     timings.regroup_s, timings.exchange_s, timings.bsr_s,
                     timings.bsr_bytes_sent, timings.total_s)
            self._event("drained", rank, record, schema.DrainedDetail(
                record.version, self.identity.device, timings.resume_step), timings.numeric(),
                every_rank=True)
            return
        log.info("switch v%d->v%d rank %d: source=%s resume_step=%d rolled_back=%s detect=%.3fs "
                 "stall=%.3fs regroup=%.3fs exchange=%.3fs bsr=%.3fs (%d B total, %d B sent, "
                 "%d B received) rebuild=%.3fs total=%.3fs", timings.from_version,
                 timings.to_version, rank, timings.source, timings.resume_step,
                 timings.rolled_back, timings.detect_s, timings.stall_s, timings.regroup_s,
                 timings.exchange_s, timings.bsr_s, timings.bsr_bytes_total,
                 timings.bsr_bytes_sent, timings.bsr_bytes_received, timings.rebuild_s,
                 timings.total_s)
        if timings.from_version or timings.source != "init":
            self._event("switch-done", rank, record, schema.SwitchDoneDetail(
                record.version, timings.from_version, timings.source, timings.rolled_back,
                timings.bsr_bytes_total, timings.resume_step), timings.numeric())

    def _event(self, type_, rank, record, detail, timings=None, every_rank=False) -> None:
        if rank != 0 and not every_rank:
            return  # one event per switch: the new plan's rank 0 writes it
        try:
            append_event(self.client, self.identity.job, type_, self.identity.node, detail,
                         timings=timings)
        except CoordinationError as exc:
            log.warning("plan v%d: could not append the %s event: %s", record.version, type_,
                        exc)


def _missing_undo(holdings: list[agree.Holding], resume: int) -> str:
    """Why holders one step ahead could not present ``resume`` (they keep no undo copy), or
    ''."""
    ahead = [r for r, h in enumerate(holdings)
             if h.version > 0 and h.step == resume + 1 and h.undo_step == agree.NO_STEP]
    if not ahead:
        return ""
    return (f"rank(s) {ahead} are at step {resume + 1} and keep no undo copy of step {resume} "
            "(undo='off')")


def check_global_batch(plan: Plan, global_batch: int) -> None:
    if plan.global_batch != global_batch:
        raise ConfigurationError(f"plan global_batch={plan.global_batch}, the script trains with "
                                 f"global_batch={global_batch}; the leader must plan for it")
