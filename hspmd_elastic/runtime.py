"""The worker API of hspmd-aware training scripts: ``run(...)`` owns the training loop and keeps
it going across plan changes, in the same process.

A script gives a model config, optimizer settings, a deterministic sampler keyed by the global
sample index (``sample(i)`` returns token row ``i``: ``seq_len + 1`` ids), the global batch size
and the step count. Step ``s`` trains on samples ``[s*B, (s+1)*B)`` whatever the plan, so an
elastic run computes what a fault-free run computes. ``run`` reads the worker environment set by
the node agent (``HSPMD_ETCD_ENDPOINTS``, ``HSPMD_JOB_ID``, ``HSPMD_NODE_ID``, ``LOCAL_RANK``),
waits for a plan that uses this device (``"<node_id>:<local_rank>"``), switches into it (see
switch.py: the first plan is a switch from nothing), trains, and on a newer plan or a dead peer
abandons the step and switches again. It returns when every rank of the current plan finished
all steps (``RunResult``), or when the newest plan does not use this device (``EXCLUDED``); a plan
that drains this device (``PlanRecord.drain``: a suspect GPU) first gets this rank's state by
network, as a BSR source of that plan's switch (``RunResult.drained``), then the worker leaves.
A worker that holds state never re-enters a plan after one it missed left its device out (a
partition healed meanwhile): it leaves, and its agent starts a fresh worker, which joins
through the BSR like any joiner (the fence is the plan version: see ``_left_out_since``).
A worker that holds nothing while the newest plan leaves its device idle stays: it probes its
device (``elastic.busy.probe``: one micro-batch through a one-layer copy of the model, no
process group, bounded by ``elastic.busy.ProbeSchedule``) and reports the probe's time in its
progress (``probe_s``, ``probes``) under that plan, so the leader can measure the idle device
and plan it back in when that pays; it waits as long as the job runs (no ``plan_wait_s``
deadline) and leaves (``EXCLUDED``) once ``rdzv/state`` records the job's end.

The worker computes where ``hspmd_elastic.devices.select_device`` puts it (``HSPMD_DEVICE``:
``cuda:<LOCAL_RANK>`` when CUDA is available and allowed, else the CPU); its model, optimizer
state, undo copy and BSR buffers live there (``run(undo="host")`` keeps the undo copy in host
memory instead, ``undo="off"`` keeps none), and its process groups use that device's backend.
A rank materialises only the rows of each global batch it reads (``rows_at`` over
``SpecializedModel.batch_rows()``: its pipeline's rows on a first or last stage, none on a middle
stage), so ``sample`` is called for those indices only.

Progress goes to a ``ProgressReporter`` (default: ``HSPMD_PROGRESS_FILE`` if set, else nothing);
the etcd worker key belongs to the node agent. Hooks for tests and tools: ``on_step(info)`` after
every step, ``on_switch(timings)`` after every switch; ``RunResult.final_state`` holds this rank's
parameter shards with their global index ranges (``gather_full`` assembles them).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from hspmd_elastic.coord import EtcdClient
from hspmd_elastic.contract import schema
from hspmd_elastic.coord.api import CoordinationError
from hspmd_elastic.contract.rounds import TERMINAL, RoundState
from hspmd_elastic.elastic.busy import BusyMeter, ProbeSchedule, probe, probe_rows
from hspmd_elastic.elastic.device_timer import step_timer
from hspmd_elastic.graph.bucketed import BucketStats, check_sampler
from hspmd_elastic.elastic.api import (ConfigurationError, Lifecycle, PlanWaitTimeout,
                                       ProgressReporter, SwitchTimings, TRANSITIONS, WorkerIdentity,
                                       WorkerProgress, WorkerState, reporter_from_env)
from hspmd_elastic.elastic.checkpoint import CheckpointWriter
from hspmd_elastic.elastic.group import (GroupFormer, RegroupAborted, RegroupTimeout,
                                         StoreUnreachable, wait_keys)
from hspmd_elastic.elastic.watchdog import PlanWatcher, Watchdog
from hspmd_elastic.coord.contract import plan_of
from hspmd_elastic.devices import DeviceSettingError, select_device, use_device
from hspmd_elastic.graph.comm import CommTimeoutError
from hspmd_elastic.graph.config import ModelConfig, param_specs
from hspmd_elastic.graph.optim import AdamWConfig
from hspmd_elastic.hf import HFCheckpointError, load_shards
from hspmd_elastic.hf.api import CONFIG_FILE
from hspmd_elastic.hf.export import gather_full  # noqa: F401 (runtime.gather_full, re-exported)
from hspmd_elastic.reshard import ReshardCommError
from hspmd_elastic.switch import (UNDO_MODES, GraphSwitch, Held, SwitchTimeouts,
                                  check_global_batch)

log = logging.getLogger("hspmd_elastic.runtime")

# At the end of a run: how long retired groups whose abandoned collectives have ended get to be
# destroyed before the process may exit (``GroupReaper.close``); it takes well under a second.
_REAPER_EXIT_S = 5.0

Sampler = Callable[[int], torch.Tensor]


@dataclass(frozen=True)
class RuntimeTimeouts(SwitchTimeouts):
    """The worker's limits: the switch's (``SwitchTimeouts``: ``regroup_s``, ``comm_s``, also
    every collective and point-to-point wait of a step, ``checkpoint_flush_s``) and its own."""

    plan_wait_s: float = 300.0  # for a (newer) plan that uses this device
    finish_s: float = 300.0  # for every rank of the plan to finish the last step
    etcd_s: float = 5.0


@dataclass(frozen=True)
class StepInfo:
    step: int  # the step just completed (0-based); the state is now at step + 1
    loss: float
    rank: int
    plan_version: int
    held: Held


@dataclass
class RunResult:
    state: WorkerState
    steps_done: int
    plan_version: int
    rank: int
    losses: dict[int, float] = field(default_factory=dict)
    switches: list[SwitchTimings] = field(default_factory=list)
    drained: Optional[SwitchTimings] = None  # the drain this worker served before it left
    final_state: dict[str, tuple[tuple, torch.Tensor]] = field(default_factory=dict)
    world_size: int = 0  # ranks of the final plan: each returns its own final_state
    # length buckets: per step this rank ran bucketed, its layout switches, their time and bytes
    bucket_stats: dict[int, BucketStats] = field(default_factory=dict)


def synthetic_sampler(config: ModelConfig, seed: int = 0) -> Sampler:
    """A deterministic token source: row ``i`` depends on (seed, i) only."""

    def sample(index: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed * 1_000_003 + index)
        return torch.randint(0, config.vocab_size, (config.seq_len + 1,), generator=gen)

    return sample


def global_batch_at(sample: Sampler, step: int, global_batch: int) -> torch.Tensor:
    """The whole global batch of ``step`` (references and tests; a rank reads ``rows_at``)."""
    return rows_at(sample, step, global_batch, (0, global_batch))


def rows_at(sample: Sampler, step: int, global_batch: int, rows: tuple[int, int]) -> torch.Tensor:
    """Rows ``[lo, hi)`` of ``step``'s global batch: only ``sample(step * global_batch + i)``
    for ``lo <= i < hi`` is called; no rows give an empty [0, 0] tensor."""
    lo, hi = rows
    if hi <= lo:
        return torch.empty((0, 0), dtype=torch.int64)
    return torch.stack([sample(step * global_batch + i) for i in range(lo, hi)])


def is_documents(sample) -> bool:
    """Whether ``sample`` is a document sampler (``hspmd_elastic.documents.DocumentSampler``:
    ``sample(i)`` gives tokens and segment ids, ``lengths(i)`` its documents' lengths)."""
    return callable(getattr(sample, "sample", None)) and callable(getattr(sample, "lengths",
                                                                          None))


def document_rows_at(sample, step: int, global_batch: int, rows: tuple[int, int]
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows_at`` of a document sampler: the rows' tokens and their segment ids."""
    lo, hi = rows
    if hi <= lo:
        empty = torch.empty((0, 0), dtype=torch.int64)
        return empty, empty
    pairs = [sample.sample(step * global_batch + i) for i in range(lo, hi)]
    return torch.stack([t for t, _ in pairs]), torch.stack([s for _, s in pairs]).long()


def counted_targets(sample, step: int, global_batch: int) -> int:
    """The targets of ``step``'s global batch that count (each document of ``l`` tokens in a row
    predicts ``l - 1``): the loss's denominator, from the documents' lengths only."""
    return sum(max(n - 1, 0) for i in range(global_batch)
               for n in sample.lengths(step * global_batch + i))


class _Context(logging.LoggerAdapter):
    def process(self, msg, kwargs):
        w = self.extra["worker"]
        return (f"[job={w.identity.job} node={w.identity.node} device={w.identity.device} "
                f"rank={w.rank} v{w.version} step={w.step}] {msg}", kwargs)


class _Worker:
    def __init__(self, identity, config, sample, global_batch, steps, optim, seed, timeouts,
                 reporter, on_step, on_switch, checkpoint_dir, checkpoint_every, fault_injector,
                 undo="device", init_from=None):
        try:
            device = select_device(identity.device_setting, identity.local_rank)
        except DeviceSettingError as exc:
            raise ConfigurationError(str(exc)) from None
        use_device(device)
        self.identity, self.config, self.sample = identity, config, sample
        self.global_batch, self.steps, self.optim, self.seed = global_batch, steps, optim, seed
        self.timeouts, self.reporter = timeouts, reporter
        self.on_step, self.on_switch = on_step, on_switch
        self.lifecycle = Lifecycle()
        self.held: Optional[Held] = None
        self.version, self.rank, self.step = 0, -1, 0
        self.stalled_since: Optional[float] = None
        self.result = RunResult(WorkerState.WAITING_PLAN, 0, 0, -1)
        self.log = _Context(log, {"worker": self})
        self.client = EtcdClient(identity.etcd_endpoints, timeout=timeouts.etcd_s,
                                 security=identity.etcd_security)
        self.plans = PlanWatcher(self.client, identity.job, relay_file=identity.relay_file)
        inject = None if fault_injector is None else (lambda what: fault_injector(self.step, what))
        self.former = GroupFormer(timeouts.comm_s, connect_timeout_s=timeouts.regroup_s,
                                  device=device)
        self.watchdog = Watchdog(self.plans, lambda: self.version, timeouts.comm_s, inject,
                                 on_abandon=self.former.abandoned, monitor=self.former.monitor)
        writer = (CheckpointWriter(checkpoint_dir, checkpoint_every)
                  if checkpoint_dir and checkpoint_every else None)
        self.checkpoints = writer
        self.switcher = GraphSwitch(
            identity, self.client, self.plans, self.former, self.watchdog, config, optim, seed,
            timeouts,
            checkpoints=writer, checkpoint_dir=checkpoint_dir, undo=undo, init_from=init_from)
        self._rate = (time.monotonic(), 0)
        self.busy = BusyMeter()  # this rank's own compute per step (elastic.busy)
        # while the plan leaves this device idle: its probes (elastic.busy.probe), each already
        # a mean over its repetitions; the leader's estimator takes the median of them
        self.probes, self.probe_meter = ProbeSchedule(), BusyMeter(window=1, skip=1, min_steps=1)
        self.probe_count = 0  # probes under the newest plan that leaves this device idle
        self.timer = step_timer(device)  # host clock, or CUDA events (elastic.device_timer)

    # ------------------------------------------------------------------------ main loop
    def run(self) -> RunResult:
        self.log.info("computing on %s (process groups: %s)", self.former.device,
                      self.former.backend)
        try:
            self.plans.start(self.timeouts.etcd_s)
            while self.lifecycle.state not in (WorkerState.DONE, WorkerState.EXCLUDED):
                record = self._wait_plan()
                if record is None:
                    self._enter(WorkerState.EXCLUDED)
                    break
                if not self._switch(record):
                    continue
                if self.result.drained is not None:
                    self._enter(WorkerState.EXCLUDED)
                    break
                if self._train() and self._finish():
                    self._enter(WorkerState.DONE)
        except BaseException as exc:
            self.log.error("failed in state %s: %s: %s", self.lifecycle.state.value,
                           type(exc).__name__, exc)
            if WorkerState.FAILED in TRANSITIONS[self.lifecycle.state]:
                self._enter(WorkerState.FAILED)
            raise
        finally:
            self._close()
        self.result.state = self.lifecycle.state
        return self.result

    def _wait_plan(self):
        """The newest plan above ours that uses or drains this device; None if we are
        excluded (or, idle, the job ended)."""
        deadline = time.monotonic() + self.timeouts.plan_wait_s
        floor, idle = self.version, None
        while True:
            if idle is not None:  # a plan runs without this device: probe it until one uses it
                record = self._idle_wait(idle)
                if record is None:
                    if self._job_ended():
                        self.log.info("the job ended while this device was idle: leaving")
                        return None
                    continue
            else:
                record = self.plans.wait_newer(floor, max(0.0, deadline - time.monotonic()))
            if record is None:
                raise PlanWaitTimeout(f"no plan newer than v{floor} using device "
                                      f"{self.identity.device} within "
                                      f"{self.timeouts.plan_wait_s:g}s")
            if self.identity.device in record.devices:
                if self.held is not None and self._left_out_since(record.version):
                    return None
                return record
            if self.identity.device in record.drain and self.held is not None:
                self.log.warning("plan v%d drains this device: handing its state over, then "
                                 "leaving", record.version)
                return record
            if self.held is not None:
                self.log.warning("plan v%d does not use this device: leaving", record.version)
                return None
            floor, idle = record.version, record  # not used yet: a later plan may add us
            self._go_idle(record)

    def _go_idle(self, record) -> None:
        """The newest plan leaves this device idle (the worker holds nothing): report it under
        that plan, with no probe yet."""
        self.log.info("plan v%d leaves this device idle: probing it while waiting for a plan "
                      "that uses it", record.version)
        self.version, self.probe_count = record.version, 0
        self._progress()

    def _idle_wait(self, plan):
        """Wait for a plan newer than ``plan`` until the next probe is due; run the probe (one
        micro-batch of ``elastic.busy.probe``, no process group) when none came."""
        newer = self.plans.wait_newer(plan.version, self.probes.wait_s(time.monotonic()))
        if newer is not None:
            return newer
        started = time.monotonic()
        try:
            took = probe(self.config, probe_rows(plan_of(plan)), self.former.device, self.seed)
        except Exception as exc:  # noqa: BLE001 - no sample is better than a failed worker
            self.log.warning("idle probe failed (%s: %s); not probing again under v%d",
                             type(exc).__name__, exc, plan.version)
            self.probes.done(time.monotonic(), self.timeouts.plan_wait_s)
            return None
        now = time.monotonic()
        self.probes.done(now, now - started)  # the duty bound counts every repetition
        self.probe_meter.add_busy(plan.version, took)
        self.probe_count += 1
        self._progress()
        return None

    def _job_ended(self) -> bool:
        """Whether ``rdzv/state`` records the job's end (an idle worker then leaves)."""
        key = schema.rdzv_state_key(self.identity.job)
        try:
            kv = self.client.get(key, timeout=self.timeouts.etcd_s)
            return kv is not None and RoundState.decode(key, kv.value, kv.mod_revision).state \
                in TERMINAL
        except (CoordinationError, ValueError) as exc:
            self.log.debug("cannot read %s (%s)", key, exc)
            return False

    def _left_out_since(self, version: int, most: int = 64) -> bool:
        """True when a plan between ours and ``version`` did not use this device (read from
        the plan history; more than ``most`` versions missed counts as left out)."""
        missed = range(self.version + 1, version)
        if len(missed) > most:
            self.log.warning("%d plans passed since v%d: leaving", len(missed), self.version)
            return True
        for v in missed:
            key = schema.plan_history_key(self.identity.job, v)
            try:
                kv = self.client.get(key, timeout=self.timeouts.etcd_s)
                old = schema.decode(key, kv.value) if kv is not None else None
            except CoordinationError as exc:  # cannot tell: a fresh worker is always safe
                self.log.warning("cannot read plan v%d (%s): leaving", v, exc)
                return True
            if old is not None and self.identity.device not in old.devices:
                self.log.warning("plan v%d left this device out while it was away: leaving "
                                 "(its agent starts a fresh worker for v%d)", v, version)
                return True
        return False

    def _switch(self, record) -> bool:
        check_global_batch(plan_of(record), self.global_batch)
        self.version = record.version
        self._enter(WorkerState.REGROUPING)
        try:
            res = self.switcher.switch(record, self.held, self.stalled_since,
                                       on_phase=self._phase)
        except Exception as exc:  # noqa: BLE001 - re-raised unless the switch was interrupted
            if not isinstance(exc, (CommTimeoutError, RegroupAborted, RegroupTimeout,
                                    StoreUnreachable, ReshardCommError)) and not self._aborted():
                raise
            self.log.warning("switch to plan v%d interrupted: %s", record.version, exc)
            self.stalled_since = self.stalled_since or time.monotonic()
            self._enter(WorkerState.WAITING_PLAN)
            return False
        self._retire_held()
        if res.held is not None and res.held.bucketed is not None:
            check_sampler(res.held.bucketed.buckets, self.sample)
        self.held, self.rank, self.step = res.held, res.rank, res.resume_step
        self.stalled_since = None
        self.watchdog.reset()
        res.timings.plan_from = self.plans.source_of(record.version)
        self.result.switches.append(res.timings)
        if self.on_switch:
            self.on_switch(res.timings)
        if res.drained:
            self.result.drained = res.timings
            return True
        self._enter(WorkerState.TRAINING)
        return True

    def _retire_held(self) -> None:
        """The held plan's groups are about to be dropped: one may still run a collective this
        rank abandoned, so they go through the reaper (see ``GroupReaper``)."""
        if self.held is not None:
            for comm in self.held.comms():
                self.former.reaper.retire(comm, what=f"plan v{self.held.version}'s groups")

    def _phase(self, phase: str) -> None:
        state = WorkerState(phase)
        if state is not self.lifecycle.state:
            self._enter(state)

    def _enter(self, state: WorkerState) -> None:
        self.lifecycle.to(state)
        if state is not WorkerState.TRAINING:  # training reports after every step
            self._progress()

    def _train(self) -> bool:
        held = self.held
        try:
            while self.step < self.steps:
                if is_documents(self.sample):  # packed documents: tokens and segment ids
                    batch, segments = document_rows_at(self.sample, self.step, self.global_batch,
                                                       held.batch_rows())
                    docs = (segments, counted_targets(self.sample, self.step,
                                                      self.global_batch))
                else:
                    batch, docs = rows_at(self.sample, self.step, self.global_batch,
                                          held.batch_rows()), None
                self.watchdog.check(f"step {self.step}")
                comm = held.model.comm
                with self.former.armed(f"step {self.step}", self.timeouts.comm_s,
                                       self.watchdog.superseded), \
                        self.timer.step(self.version, comm):
                    loss = held.train_step(batch, *(docs or ()))
                for done in self.timer.finished():  # CUDA: earlier steps, read back now
                    self.busy.add_busy(done.plan_version, done.busy_s)
                self.result.losses[self.step] = loss
                if held.bucketed is not None:
                    self.result.bucket_stats[self.step] = held.bucketed.stats
                self.step = held.step
                if self.checkpoints and self.checkpoints.due(self.step):
                    self.checkpoints.submit(self.step, self.config, held.plan, self.rank,
                                            held.tensors_at(self.step))
                self._progress()
                if self.on_step:
                    self.on_step(StepInfo(self.step - 1, loss, self.rank, self.version, held))
        except Exception as exc:  # noqa: BLE001 - re-raised unless the step was abandoned
            # a newer plan (SwitchRequested) or a dead peer (CommTimeoutError, or a bucket's
            # in-step BSR whose transfer the peer's death broke: ReshardCommError); after the
            # monitor aborted the communicators, whatever the released thread ran into
            if not isinstance(exc, (CommTimeoutError, ReshardCommError)) and not self._aborted():
                raise
            self.log.warning("step %d abandoned: %s", self.step, exc)
            if self.watchdog.first_failure_at is not None:
                self.stalled_since = self.watchdog.first_failure_at
            self._enter(WorkerState.WAITING_PLAN)
            return False
        self._enter(WorkerState.FINISHING)
        return True

    def _aborted(self) -> bool:
        return self.former.comms_aborted() is not None

    def _finish(self) -> bool:
        """Wait until every rank of the plan finished (a rank that dies before that is replaced
        by a switch, in which this rank must take part)."""
        store, world = self.former.store, len(self.held.devices)
        try:
            store.set(f"done/{self.rank}", "1")
            wait_keys(store, [f"done/{r}" for r in range(world)],
                      aborted=lambda: self.plans.newer_than(self.version) is not None,
                      deadline=time.monotonic() + self.timeouts.finish_s,
                      what=f"plan v{self.version}: ranks finishing")
        except (RegroupAborted, StoreUnreachable, RuntimeError) as exc:
            self.log.warning("waiting for the other ranks to finish: %s", exc)
            self._enter(WorkerState.WAITING_PLAN)
            return False
        held = self.held
        self.result.steps_done, self.result.plan_version, self.result.rank = (
            self.step, self.version, self.rank)
        self.result.world_size = world
        specs = held.model.state_tensors()
        self.result.final_state = {
            name: (tuple(specs[name][1].local_slices(self.rank, _full_shape(self.config, name))),
                   p.detach().to("cpu", copy=True))
            for name, p in held.model.params.items()}
        self.log.info("finished %d steps", self.step)
        return True

    def _progress(self) -> None:
        now, (t0, s0) = time.monotonic(), self._rate
        rate = (self.step - s0) / (now - t0) if now > t0 and self.step > s0 else 0.0
        if self.step != s0:
            self._rate = (now, self.step)
        try:
            probe_s, probes = self._probed()
            self.reporter.report(WorkerProgress(os.getpid(), self.rank, self.identity.local_rank,
                                                self.version, self.step, time.time(), rate,
                                                self.busy.busy_s, probe_s, probes,
                                                state=self.lifecycle.state.value))
        except OSError as exc:
            self.log.warning("progress report failed: %s", exc)

    def _probed(self) -> tuple[float, int]:
        """(probe_s, probes) of the report: this device's probes while a plan leaves it idle."""
        if self.held is not None or self.probe_count == 0:
            return 0.0, 0
        return self.probe_meter.busy_s, self.probe_count

    def _close(self) -> None:
        if self.checkpoints is not None:
            self.checkpoints.flush(30.0)
        self._retire_held()
        self.former.leave()
        self.former.close()
        self.former.reaper.close(_REAPER_EXIT_S)
        self.plans.stop()
        self.client.close()


def _full_shape(config: ModelConfig, name: str) -> tuple[int, ...]:
    return param_specs(config)[name].shape


def run(config: ModelConfig, *, sample: Sampler, global_batch: int, steps: int,
        optim: AdamWConfig = AdamWConfig(), seed: int = 0,
        checkpoint_dir: Optional[str] = None, checkpoint_every: int = 0,
        timeouts: RuntimeTimeouts = RuntimeTimeouts(),
        reporter: Optional[ProgressReporter] = None,
        on_step: Optional[Callable[[StepInfo], None]] = None,
        on_switch: Optional[Callable[[SwitchTimings], None]] = None,
        identity: Optional[WorkerIdentity] = None,
        fault_injector: Optional[Callable[[int, str], None]] = None,
        undo: str = "device", init_from: Optional[str] = None) -> RunResult:
    """Train ``steps`` steps of ``global_batch`` rows elastically (see the module docstring).

    ``init_from``: a Hugging Face checkpoint directory (``config.json`` with
    ``model.safetensors`` or a sharded ``model.safetensors.index.json``) holding ``config``'s
    weights (``hf.config_from_hf``). The job's first switch, the one that finds no state held
    anywhere, builds each rank's state from it (``hf.initial_state_from_hf``: the rank reads only
    the byte ranges of its own slices; AdamW moments start at zero, step 0) instead of the seed.
    It is never read again: a later switch gets the state from the survivors (BSR) or from the
    newest checkpoint in ``checkpoint_dir``, and a complete checkpoint already in
    ``checkpoint_dir`` wins over it (a resumed fine-tune continues from there). A path that is
    not such a checkpoint of ``config`` (missing files or tensors, other shapes: checked from
    the file headers, no weight is read) is a one-line ``ConfigurationError`` before training.

    ``undo`` is where the one-step undo copy lives (``switch.Held``): ``"device"`` (with the
    model), ``"host"`` (host memory, for an accelerator short of memory) or ``"off"``.
    ``fault_injector(step, what)`` is a seam for fault tests: it is called before every
    communication wait; raising ``CommTimeoutError`` there makes that wait fail."""
    if steps < 0 or global_batch < 1:
        raise ConfigurationError(f"steps={steps} must be >= 0 and global_batch={global_batch} "
                                 ">= 1")
    if undo not in UNDO_MODES:
        raise ConfigurationError(f"undo={undo!r}; valid: {', '.join(map(repr, UNDO_MODES))}")
    if checkpoint_every and not checkpoint_dir:
        raise ConfigurationError("checkpoint_every is set but checkpoint_dir is not")
    if init_from is not None:
        check_hf_checkpoint(init_from, config)
    worker = _Worker(identity or WorkerIdentity.from_env(), config, sample, global_batch, steps,
                     optim, seed, timeouts, reporter or reporter_from_env(), on_step, on_switch,
                     checkpoint_dir, checkpoint_every, fault_injector, undo, init_from)
    return worker.run()


def check_hf_checkpoint(path: str, config: ModelConfig) -> None:
    """``path`` is a Hugging Face checkpoint of ``config``: a directory with ``config.json``,
    every tensor of the model, nothing else, in the config's shapes (read from the safetensors
    headers: an empty slice of each tensor); else a one-line ``ConfigurationError``."""
    if not os.path.isdir(path):
        raise ConfigurationError(f"init_from={path!r} is not a directory (a Hugging Face "
                                 f"checkpoint directory with {CONFIG_FILE} and safetensors)")
    if not os.path.isfile(os.path.join(path, CONFIG_FILE)):
        raise ConfigurationError(f"init_from={path!r} holds no {CONFIG_FILE}: not a Hugging "
                                 "Face checkpoint directory")
    empty = {n: tuple((0, 0) for _ in s.shape) for n, s in param_specs(config).items()}
    try:
        load_shards(path, config, empty)
    except HFCheckpointError as exc:
        raise ConfigurationError(f"init_from={path!r}: {exc}") from None
