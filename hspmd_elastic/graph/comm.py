"""The process groups a plan needs, and every wait on communication, with a deadline.

Which groups exist is a pure function of the plan (``group_members``); every rank of the world
creates them in that same order, members or not, because torch.distributed requires it.

Every collective and point-to-point operation here is issued with ``async_op=True`` and waited on
through one ``Waiter``. The default waiter gives each wait a deadline and raises
``CommTimeoutError``; the runtime can pass its own waiter (a watchdog that also watches for plan
changes) without touching the graph code.

The sub-groups use the backend the default group was formed with (``gloo`` on CPU workers,
``cpu:gloo,cuda:nccl`` on CUDA ones: ``hspmd_elastic.devices.backend_for`` chooses it once), and
``Comm.device`` is where the plan's tensors live (receive buffers of the pipeline, the loss).

Creating the groups blocks inside gloo until every member connects (up to the group timeout).
``Comm.create(..., store=, aborted=)`` first meets every rank of the world at a barrier on
``store`` that it polls, so a rank that never comes (dead, or gone to a newer plan) costs the
others one ``aborted()`` check (``CommAborted``) or the deadline, not a blocked ``new_group``.
A rank that dies after the barrier, while the groups connect, is still waited for up to the
group timeout.

Inside ``with bracket_waits(hooks):`` every ``Comm.wait`` on that thread calls ``hooks.pause()``
before it waits and ``hooks.resume()`` after a wait that returned (``elastic/device_timer.py``
cuts a step into compute segments there); ``with waiting():`` brackets a wait that does not go
through ``Comm.wait`` the same way.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Protocol, Sequence

import torch
import torch.distributed as dist

from hspmd_elastic.devices import completes_at_enqueue
from hspmd_elastic.graph.config import ModelConfig
from hspmd_elastic.plan import Plan, PlanError
from hspmd_elastic.graph.gradsync import sync_group_members


class GraphError(RuntimeError):
    """Base of the errors raised while building or running a specialized graph."""


class CommTimeoutError(GraphError):
    """A communication failed or did not complete before its deadline (a peer is dead or stuck)."""


class CommAborted(CommTimeoutError):
    """Creating the plan's groups was abandoned because ``aborted()`` said so (a newer plan)."""


_BARRIER_POLL_FIRST_S = 0.001
_BARRIER_POLL_MAX_S = 0.02


def store_barrier(store, key: str, rank: int, world: int, deadline: float,
                  aborted: Callable[[], bool]) -> None:
    """Meet ``world`` ranks at ``key`` on ``store`` by polling: returns when all arrived;
    ``CommAborted`` when ``aborted()``; ``CommTimeoutError`` at ``deadline`` (monotonic)."""
    keys = [f"{key}/{r}" for r in range(world)]
    delay = _BARRIER_POLL_FIRST_S
    try:
        store.set(keys[rank], "1")
        while not store.check(keys):
            if aborted():
                raise CommAborted(f"barrier {key!r}: abandoned, a newer plan was published")
            if time.monotonic() >= deadline:
                missing = [k for k in keys if not store.check([k])]
                raise CommTimeoutError(f"barrier {key!r}: still missing {missing} at the "
                                       "deadline")
            time.sleep(delay)  # a remote store: nothing to wait on locally
            delay = min(delay * 2, _BARRIER_POLL_MAX_S)
    except RuntimeError as exc:
        if isinstance(exc, CommTimeoutError):
            raise
        raise CommTimeoutError(f"barrier {key!r}: the store failed: {exc}") from exc


class WaitHooks(Protocol):
    def pause(self) -> None: ...

    def resume(self) -> None: ...


_wait_hooks: contextvars.ContextVar[Optional[WaitHooks]] = contextvars.ContextVar(
    "hspmd_wait_hooks", default=None)


@contextlib.contextmanager
def bracket_waits(hooks: WaitHooks) -> Iterator[None]:
    """While inside, every ``Comm.wait`` on this thread is bracketed by ``hooks``."""
    token = _wait_hooks.set(hooks)
    try:
        yield
    finally:
        _wait_hooks.reset(token)


@contextlib.contextmanager
def waiting() -> Iterator[None]:
    """Bracket, like ``Comm.wait``, a wait on communication that does not go through it."""
    hooks = _wait_hooks.get()
    if hooks is not None:
        hooks.pause()
    yield
    if hooks is not None:
        hooks.resume()


# A waiter blocks until ``work`` completes or raises; ``what`` names the operation for errors.
Waiter = Callable[[object, str], None]


def deadline_waiter(timeout_s: float) -> Waiter:
    """The default waiter: each wait may take at most ``timeout_s`` seconds."""

    def wait(work, what: str) -> None:
        try:
            work.wait(timeout=datetime.timedelta(seconds=timeout_s))
        except RuntimeError as exc:
            raise CommTimeoutError(
                f"{what} failed or did not complete within {timeout_s:g}s: {exc}") from exc

    return wait


def group_members(plan: Plan, config: ModelConfig) -> list[tuple[int, ...]]:
    """Every multi-device group a plan's execution uses, sorted, deduplicated, in creation order.

    TP groups, the gradient-synchronisation groups and the group of all plan devices (loss).
    """
    members = {tuple(sorted(s.devices)) for p in plan.pipelines for s in p.stages}
    members |= set(sync_group_members(plan.param_layouts(config)))
    members.add(plan.devices)
    return sorted((m for m in members if len(m) > 1), key=lambda m: (len(m), m))


@dataclass
class Comm:
    """Process groups of one plan keyed by their sorted members, and the waiter for all waits."""

    groups: dict[tuple[int, ...], object]
    rank: int
    waiter: Waiter
    device: torch.device = torch.device("cpu")
    _pending: list = field(default_factory=list)
    _held_sends: list = field(default_factory=list)  # CUDA: posted with the next receive
    # seconds spent in waits on communication since the groups were made (the runtime's busy
    # time of a step is the step's time minus what this grew by)
    waited_s: float = 0.0
    # point-to-point as on NCCL (a backend that ``devices.completes_at_enqueue``, or CUDA):
    # sends held and batched with the next receive (see ``send``)
    ordered_p2p: bool = False

    @classmethod
    def create(cls, plan: Plan, config: ModelConfig, rank: int, *, timeout_s: float = 60.0,
               waiter: Optional[Waiter] = None, store=None,
               aborted: Optional[Callable[[], bool]] = None,
               barrier_key: str = "comm-create",
               device: torch.device | str = "cpu",
               group_timeout_s: Optional[float] = None) -> "Comm":
        """Create the plan's groups; every rank of the default group must call this.

        With ``store`` (a store every rank shares, fresh keys for ``barrier_key``), the ranks
        first meet at a polled barrier there, abandoned with ``CommAborted`` as soon as
        ``aborted()`` is true, or with ``CommTimeoutError`` after ``timeout_s``. The groups
        use the default group's backend, with ``group_timeout_s`` as torch's own timeout
        (default ``timeout_s``; on NCCL ``GroupFormer.group_timeout_s``, above ours); ``device``
        is where the plan's tensors live. On NCCL the groups' communicators are ready only after
        their first operation: ``GroupFormer.ready`` makes it, bounded."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        if max(plan.devices) >= world:
            raise PlanError(f"plan uses device {max(plan.devices)} but the world has {world} ranks")
        timeout = datetime.timedelta(seconds=timeout_s if group_timeout_s is None
                                     else group_timeout_s)
        if store is not None and world > 1:
            store_barrier(store, barrier_key, rank, world, time.monotonic() + timeout_s,
                          aborted or (lambda: False))
        groups = {}
        backend = dist.get_backend() if dist.is_initialized() else "gloo"
        for members in group_members(plan, config):
            group = dist.new_group(list(members), timeout=timeout, backend=backend)
            if rank in members:
                groups[members] = group
        device = torch.device(device)
        return cls(groups, rank, waiter or deadline_waiter(timeout_s), device,
                   ordered_p2p=device.type == "cuda" or completes_at_enqueue(backend))

    def group(self, devices: Sequence[int]):
        return self.groups[tuple(sorted(devices))]

    def wait(self, work, what: str) -> None:
        hooks = _wait_hooks.get()
        if hooks is not None:
            hooks.pause()
        started = time.perf_counter()
        try:
            self.waiter(work, what)
        finally:
            self.waited_s += time.perf_counter() - started
        if hooks is not None:
            hooks.resume()

    @staticmethod
    def post(start: Callable[[], object], what: str):
        """Issue an async operation. gloo may already know a peer is gone when the operation is
        posted (``Connection closed by peer``) and raise right there, before any wait: that is
        the same failure a wait would report, so it gets the same type."""
        try:
            return start()
        except RuntimeError as exc:
            raise CommTimeoutError(f"{what} failed: {str(exc).splitlines()[0][:200]}") from exc

    # ---- collectives (synchronous from the caller's view, waited through the waiter) -------
    def all_reduce(self, tensor: torch.Tensor, devices: Sequence[int],
                   op: str = "sum") -> torch.Tensor:
        """Reduce ``tensor`` in place over ``devices`` with ``op`` ("sum" or "max"; a no-op on
        one device)."""
        if len(devices) > 1:
            what = f"all_reduce{'' if op == 'sum' else f'({op})'} over {tuple(sorted(devices))}"
            reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
            work = self.post(lambda: dist.all_reduce(tensor, op=reduce_op,
                                                     group=self.group(devices),
                                                     async_op=True), what)
            self.wait(work, what)
        return tensor

    def all_gather(self, tensor: torch.Tensor, devices: Sequence[int]) -> list[torch.Tensor]:
        """The ``tensor`` of every device, in the order ``devices`` lists them."""
        if len(devices) == 1:
            return [tensor]
        out = [torch.empty_like(tensor) for _ in devices]  # group ranks follow sorted devices
        what = f"all_gather over {tuple(sorted(devices))}"
        work = self.post(lambda: dist.all_gather(out, tensor.contiguous(),
                                                 group=self.group(devices), async_op=True), what)
        self.wait(work, what)
        by_device = dict(zip(sorted(devices), out))
        return [by_device[d] for d in devices]

    # ---- point to point ------------------------------------------------------------------
    # On NCCL (CUDA, or ``ordered_p2p``: any backend with its semantics), a pair's sends and
    # receives match by posting order, tags ignored, on one stream, and a send
    # larger than NCCL's buffers waits for its receive: a stage that sends an activation, then
    # receives a gradient, while its neighbour sends that gradient, then receives the activation,
    # would deadlock. So there a send is held and posted with the next receive in one
    # ``batch_isend_irecv`` (one NCCL group: its operations progress together), or by
    # ``flush_sends``; a receive with no send held is a batch of one, so every CUDA p2p is
    # batched on both sides and matches on every admitted torch. On gloo a send is posted at
    # once, as before.
    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        """Start sending; the send completes by ``flush_sends``."""
        tensor = tensor.contiguous()
        if self.ordered_p2p or self.device.type == "cuda":
            self._held_sends.append((tensor, dst, tag))
            return
        work = self.post(lambda: dist.isend(tensor, dst, tag=tag), f"send to rank {dst} tag {tag}")
        self._pending.append((work, tensor, dst, tag))

    def recv(self, tensor: torch.Tensor, src: int, tag: int) -> torch.Tensor:
        what = f"recv from rank {src} tag {tag}"
        if self._held_sends or self.ordered_p2p or self.device.type == "cuda":
            # CUDA: every point-to-point goes through batch_isend_irecv, so a receive always
            # matches its peer's batched send (a lone ``irecv`` matches one only from torch 2.8)
            self._post_held(dist.P2POp(dist.irecv, tensor, src, tag=tag), what)
            return tensor
        self.wait(self.post(lambda: dist.irecv(tensor, src, tag=tag), what), what)
        return tensor

    def flush_sends(self) -> None:
        if self._held_sends:
            self._post_held(None, "sends")
        pending, self._pending = self._pending, []
        for work, _tensor, dst, tag in pending:
            self.wait(work, f"send to rank {dst} tag {tag}")

    def _post_held(self, recv: Optional[dist.P2POp], what: str) -> None:
        """Post the held sends (and ``recv``) as one batch and wait for all of it."""
        held, self._held_sends = self._held_sends, []
        ops = [dist.P2POp(dist.isend, t, dst, tag=tag) for t, dst, tag in held]
        ops += [recv] if recv is not None else []
        what = f"{what} with {len(held)} send(s) to rank(s) {sorted({d for _t, d, _g in held})}"
        for work in self.post(lambda: dist.batch_isend_irecv(ops), what):
            self.wait(work, what)
