"""One rank's specialized graph: its stage's layers and TP shards, and the communication they imply.

``SpecializedModel.build(config, plan, rank, seed=...)`` initialises the rank's shards from the
seed; ``build(..., state=tensors)`` binds given shards instead (after a reshard), without
initialising. ``step(batch)`` runs one training step on the global batch or on just the rows
``batch_rows()`` names (a middle stage needs none): this pipeline's slice of the batch
through the 1F1B schedule, gradient synchronisation across pipelines, AdamW on local shards, and
returns the global mean loss (the same value on every rank). A step that fails in communication
changes no state, so the runtime can rerun it after a switch; ``step(batch, before_update=f)``
calls ``f()`` once all of the step's communication succeeded and before any state changes (the
runtime copies its one-step undo state there, so a failed step costs no copy).
``state_tensors()`` exposes the parameters and optimizer state with their HSPMD annotations,
the input of resharding.

Uneven optimizer shards (``plan.optimizer_shards == "uneven"``, ``zero.py``): the gradient sum
of a split parameter reaches only each row's owner (reduce-scatter), the owner updates its rows
with its own moments, out of place, and one all-gather per synchronisation group brings every
holder the new rows; ``before_update`` runs after that all-gather and the state changes only
then, so the step keeps its promise: a step that fails in communication changes no state.

Process groups: the default group's ranks are the plan's devices; building creates the plan's
sub-groups, which every rank of the default group must do together (``Comm.create``).

Placement: parameters, their AdamW moments and every activation live on ``comm.device`` (the CPU,
or the worker's GPU: ``hspmd_elastic.devices``); the global batch may come from the host and is
moved there. The step counter stays a host scalar (reading it never waits for the GPU).

State tensors are named and annotated as ``state.state_specs`` says (parameters, their AdamW
moments, the step counter).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Mapping, Optional

import torch

from hspmd_elastic.graph.comm import Comm, GraphError, Waiter
from hspmd_elastic.graph.config import ModelConfig, param_specs
from hspmd_elastic.graph.gradsync import apply_rows, gather_rows, sync_gradients, sync_ops
from hspmd_elastic.graph.init import full_param, local_part
from hspmd_elastic.graph.layers import TPGroup
from hspmd_elastic.graph.model import (StageModule, compute_context, document_masks,
                                       token_loss_sum, torch_dtype)
from hspmd_elastic.graph.optim import AdamWConfig, ShardedAdamW
from hspmd_elastic.graph.pipeline import StageLinks, one_f_one_b, run_schedule
from hspmd_elastic.graph.state import EXP_AVG, EXP_AVG_SQ, STEP, state_specs
from hspmd_elastic.graph.zero import is_uneven, local_owned_rows, plan_cuts
from hspmd_elastic.plan import Plan


def rank_rows(plan: Plan, rank: int) -> tuple[int, int]:
    """The rows ``[lo, hi)`` of the global batch ``rank`` reads under ``plan``: its pipeline's
    rows on a first or last stage (tokens in, targets out), none (``lo == hi``) on a middle
    stage, which only receives activations."""
    where = plan.locate(rank)
    lo, hi = plan.batch_rows(where.pipeline)
    ends = where.stage in (0, len(plan.pipelines[where.pipeline].stages) - 1)
    return (lo, hi) if ends else (lo, lo)


class StateError(GraphError):
    """Given state tensors do not match what this rank holds (names or shapes)."""


class SpecializedModel:
    """The part of the model one rank runs under one plan."""

    def __init__(self, config: ModelConfig, plan: Plan, rank: int, comm: Comm,
                 optim: AdamWConfig) -> None:
        plan.check_model(config)
        self.config, self.plan, self.rank, self.comm = config, plan, rank, comm
        self.placement = plan.locate(rank)
        pipe = plan.pipelines[self.placement.pipeline]
        self.pipeline = pipe
        stage = pipe.stages[self.placement.stage]
        self.tp = TPGroup(stage.devices, self.placement.tp_rank, comm)
        self.device = comm.device
        # parameters and rope tables are allocated on the device, not moved there
        with (self.device if self.device.type != "cpu" else contextlib.nullcontext()):
            self.module = StageModule(config, stage.layers, self.tp,
                                      first=self.placement.stage == 0,
                                      last=self.placement.stage == len(pipe.stages) - 1)
        self.params = dict(self.module.named_parameters())
        self.optimizer = ShardedAdamW(self.params, optim, local_owned_rows(plan, config, rank))
        self._sync = sync_ops(plan.param_layouts(config), rank, plan_cuts(plan, config))
        self._links = StageLinks.of([s.devices for s in pipe.stages], self.placement.stage,
                                    self.placement.tp_rank)
        self._schedule = one_f_one_b(len(pipe.stages), self.placement.stage, pipe.num_microbatches)
        self._specs = None

    # ---- construction --------------------------------------------------------------------
    @classmethod
    def build(cls, config: ModelConfig, plan: Plan, rank: int, *, seed: int = 0,
              state: Optional[Mapping[str, torch.Tensor]] = None, comm: Optional[Comm] = None,
              optim: AdamWConfig = AdamWConfig(), timeout_s: float = 60.0,
              waiter: Optional[Waiter] = None,
              device: torch.device | str = "cpu") -> "SpecializedModel":
        """Build ``rank``'s graph. Every rank of the world must call this (or ``Comm.create``)
        together, since it creates the plan's process groups; pass ``comm`` to reuse them (its
        device wins over ``device``)."""
        plan.check_model(config)
        if comm is None:
            comm = Comm.create(plan, config, rank, timeout_s=timeout_s, waiter=waiter,
                               device=device)
        model = cls(config, plan, rank, comm, optim)
        if state is None:
            model.init_params(seed)
        else:
            model.load_state_tensors(state)
        return model

    @torch.no_grad()
    def init_params(self, seed: int) -> None:
        """The seed's initial values of this rank's shards: the ranges its annotations name
        (a replicated key/value part included), cut from each full parameter."""
        specs = param_specs(self.config)
        annotations = self.plan.param_annotations(self.config)
        for name, p in self.params.items():
            spec = specs[name]
            ranges = annotations[name].local_slices(self.rank, spec.shape)
            p.copy_(local_part(full_param(spec, self.config, seed), ranges))

    # ---- training ------------------------------------------------------------------------
    def batch_rows(self) -> tuple[int, int]:
        """The rows of the global batch this rank reads (``rank_rows``)."""
        return rank_rows(self.plan, self.rank)

    def step(self, batch: torch.Tensor,
             before_update: Optional[Callable[[], None]] = None,
             segments: Optional[torch.Tensor] = None, real_tokens: Optional[int] = None
             ) -> float:
        """One optimizer step (``gradients`` then ``update``); the global mean loss."""
        grads, loss = self.gradients(batch, segments, real_tokens)
        self.update(grads, before_update)
        return loss

    def gradients(self, batch: torch.Tensor, segments: Optional[torch.Tensor] = None,
                  real_tokens: Optional[int] = None
                  ) -> tuple[dict[str, torch.Tensor], float]:
        """This rank's gradients of the step, synchronised under the plan (every replica of a
        shard holds the sum; with uneven optimizer shards, only the rows this rank owns of a
        split parameter do), and the global loss; no state changes. ``batch`` is the global batch
        [global_batch, seq+1] or only this rank's rows ``batch_rows()`` (what a rank needs to
        materialise).

        Packed documents: ``segments`` (the rows' segment ids, shaped as ``batch``; 0 is
        padding) restrict attention to each document and the loss to the targets that continue
        one (``model.document_masks``); the loss is then the mean over ``real_tokens``, the
        global batch's count of such targets (every rank passes the same number).

        ``update(grads, before_update)`` applies them; ``before_update()`` runs after the step's
        last communication, before the update."""
        batch, first_row = self._local_batch(batch)
        batch = batch.to(self.device, non_blocking=True)
        if segments is not None:
            segments = self._local_batch(segments)[0].to(self.device, non_blocking=True)
            if not real_tokens or real_tokens < 1:
                raise GraphError(f"real_tokens={real_tokens!r}: packed documents need the "
                                 "global batch's count of targets that count (>= 1)")
        self.optimizer.zero_grad()
        pi = self.placement.pipeline
        mb = self.pipeline.microbatch_size
        tokens = self.config.seq_len * self.plan.global_batch if segments is None \
            else real_tokens
        head = self.module if self.module.last else None

        def rows(m, of=None):
            lo, hi = self.plan.microbatch_rows(pi, m)
            return (batch if of is None else of)[lo - first_row:hi - first_row]

        made: dict = {}  # micro-batch -> its masks: built once, read by forward and loss

        def masks(m):
            if segments is None:
                return None, None
            if m not in made:
                made[m] = document_masks(rows(m, segments))
            return made[m]

        def forward(m, x):
            with compute_context(self.config, self.device):
                return self.module(rows(m)[:, :-1] if x is None else x, masks(m)[0])

        def loss_of(m, logits):
            return token_loss_sum(logits, rows(m)[:, 1:], self.tp, head.vocab_start,
                                  masks(m)[1]) / tokens

        dtype = torch_dtype(self.config)
        loss = run_schedule(self._schedule, self._links, self.comm, forward=forward,
                            loss_of=loss_of, dtype=dtype, device=self.device,
                            activation_shape=(mb, self.config.seq_len, self.config.hidden_size))
        grads = {n: p.grad if p.grad is not None else torch.zeros_like(p)
                 for n, p in self.params.items()}
        sync_gradients(self._sync, grads, self.comm)
        return grads, self._global_loss(loss)

    def update(self, grads: Mapping[str, torch.Tensor],
               before_update: Optional[Callable[[], None]] = None) -> None:
        """AdamW with ``grads`` (this rank's shards, synchronised); all communication of the
        step is done: state changes only now, so a step interrupted by a communication error
        leaves parameters and optimizer state as they were. Uneven optimizer shards: the update
        of the owned rows is staged, the new rows are exchanged (the step's last
        communication), then ``before_update`` runs and the state changes."""
        for n, p in self.params.items():
            p.grad = grads[n]
        if is_uneven(self.plan):
            self._update_owned(before_update)
            return
        if before_update is not None:
            before_update()
        self.optimizer.step()

    def _update_owned(self, before_update: Optional[Callable[[], None]]) -> None:
        """Uneven optimizer shards: stage the owned rows' update, gather every holder's new rows
        (communication), then ``before_update`` and the commit."""
        staged = self.optimizer.staged_step()
        owned = self.optimizer.owned

        def new_rows(name: str, lo: int, hi: int) -> torch.Tensor:
            dim, start, _stop = owned[name]
            return staged.params[name].narrow(dim, lo - start if hi > lo else 0, hi - lo)

        writes = gather_rows(self._sync, new_rows,
                             {n: tuple(p.shape) for n, p in self.params.items()}, self.comm)
        if before_update is not None:
            before_update()
        with torch.no_grad():
            self.optimizer.commit(staged)
            apply_rows(writes, {n: p.data for n, p in self.params.items()})

    def _global_loss(self, loss: torch.Tensor) -> float:
        # One contribution per pipeline: TP rank 0 of its last stage.
        last = self.placement.stage == len(self.pipeline.stages) - 1
        mine = loss if last and self.placement.tp_rank == 0 else torch.zeros_like(loss)
        return float(self.comm.all_reduce(mine.reshape(1).clone(), self.plan.devices)[0])

    def _local_batch(self, batch: torch.Tensor) -> tuple[torch.Tensor, int]:
        """``batch`` and the global index of its first row."""
        lo, hi = self.batch_rows()
        width = self.config.seq_len + 1
        if tuple(batch.shape) == (self.plan.global_batch, width):
            return batch, 0
        if tuple(batch.shape) == (hi - lo, width) or (hi == lo and batch.numel() == 0):
            return batch, lo
        raise GraphError(f"batch shape {tuple(batch.shape)}; expected "
                         f"{(self.plan.global_batch, width)} (global_batch, seq_len + 1) or "
                         f"{(hi - lo, width)} (this rank's rows [{lo}, {hi}))")

    # ---- state for resharding ------------------------------------------------------------
    def state_tensors(self) -> dict[str, tuple[torch.Tensor, object]]:
        """Every local state tensor (live, not a copy) with its annotation under this plan."""
        if self._specs is None:
            self._specs = state_specs(self.config, self.plan)
        return {name: (t, self._specs[name].annotation) for name, t in self._local_state().items()}

    @torch.no_grad()
    def load_state_tensors(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Bind given local shards (same names as ``state_tensors``); all must be present."""
        targets = self._local_state()
        missing = sorted(set(targets) - set(tensors))
        if missing:
            raise StateError(f"rank {self.rank}: missing state tensors {missing[:4]}"
                             f"{' ...' if len(missing) > 4 else ''}")
        for name, target in targets.items():
            value = tensors[name]
            if tuple(value.shape) != tuple(target.shape):
                raise StateError(f"rank {self.rank}: state tensor {name} has shape "
                                 f"{tuple(value.shape)}; expected {tuple(target.shape)}")
            target.copy_(value)

    def _local_state(self) -> dict[str, torch.Tensor]:
        out = {}
        for name, p in self.params.items():
            out[name] = p.data
            out[name + EXP_AVG] = self.optimizer.exp_avg[name]
            out[name + EXP_AVG_SQ] = self.optimizer.exp_avg_sq[name]
        out[STEP] = self.optimizer.step_count
        return out

    def local_params(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.params.items()}
