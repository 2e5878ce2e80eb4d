"""Run a fused BSR schedule over torch.distributed (gloo on CPU, NCCL on GPU).

One call per rank, every rank of the group calls it with the same schedule. Per peer and dtype,
the rank packs the small boxes it sends into one contiguous buffer; a large box (see
``FusedSchedule.solo_bytes``) travels as its own message, sent from and received into the tensors
themselves when their memory is contiguous (no copy). Every send and receive is posted in one
``batch_isend_irecv`` round and waited for with a deadline; staged receives are then unpacked.
A rank that holds nothing new still sends; a rank with nothing to do returns at once. A shard
whose box and device do not change is returned as the same tensor object (rebound, not copied).

Effects only: all decisions were made by the planner. A timeout raises ``ReshardTimeoutError``;
after it the process group must be rebuilt (gloo closes the pair on a timed-out receive).

``should_abort`` (optional) is looked at every ``poll_s`` while transfers are pending; when it
returns true the exchange is abandoned with ``ReshardAborted`` (a newer plan: a peer may have left
the exchange and will never send). Gloo's point-to-point works progress only inside ``wait()``,
so with ``should_abort`` they are waited on by one helper thread, with the full deadline, while
the caller polls; an abandoned helper ends at that deadline or when the group is destroyed, and
the process group must be rebuilt as after a timeout. Receives land only in fresh buffers, so
an abandoned exchange never writes into the caller's tensors.

On CUDA (``device`` a GPU, the group's CUDA part NCCL), packing, the staged receive buffers and
unpacking stay on the device; completion is polled (NCCL's ``wait`` only orders streams; so on
any backend that ``devices.completes_at_enqueue``), then
each work is waited on by the calling thread so that its stream orders the unpacking after the
transfers. Call ``torch.cuda.set_device`` first and run one collective on the group before the
first exchange, as ``batch_isend_irecv`` requires when it is a group's first operation
(``elastic.group.GroupFormer`` warms every plan's group so).
"""

from __future__ import annotations

import datetime
import threading
import time
from typing import Callable, Mapping, Optional

import torch
import torch.distributed as dist

from hspmd_elastic.devices import completes_at_enqueue
from hspmd_elastic.reshard.api import (
    ExchangeStats,
    FusedSchedule,
    Message,
    ReshardCommError,
    ReshardPlanError,
    ReshardTimeoutError,
)

_POLL_S = 0.001
ABORT_POLL_S = 0.02  # how often a pending exchange looks at ``should_abort``


class ReshardAborted(ReshardCommError):
    """The exchange was abandoned because ``should_abort`` said so (a newer plan exists)."""


def _view(tensor: torch.Tensor, box, origin) -> torch.Tensor:
    return tensor[tuple(slice(lo - o, hi - o) for (lo, hi), o in zip(box, origin))]


def _origin(ranges) -> tuple[int, ...]:
    return tuple(lo for lo, _ in ranges)


def _old_shard(schedule: FusedSchedule, name: str, rank: int, local_tensors: Mapping[str, torch.Tensor]):
    spec = schedule.spec(name)
    ranges = spec.old.local_slices(rank, spec.shape)
    tensor = local_tensors.get(name)
    expected = tuple(hi - lo for lo, hi in ranges) if ranges is not None else None
    if tensor is None or expected is None or tuple(tensor.shape) != expected:
        got = None if tensor is None else tuple(tensor.shape)
        raise ReshardPlanError(
            f"rank {rank}: tensor {name!r} needs its old local shard of shape {expected}, got {got}"
        )
    if str(tensor.dtype) != f"torch.{spec.dtype}":
        raise ReshardPlanError(f"rank {rank}: tensor {name!r} is {tensor.dtype}, planned {spec.dtype}")
    return tensor, _origin(ranges)


def _unmoved(schedule: FusedSchedule, rank: int, local_tensors, device: torch.device):
    """Old shards this rank keeps unchanged (same box, already on ``device``), by name."""
    out = {}
    for t in schedule.local_of(rank):
        spec = schedule.spec(t.tensor)
        box = spec.old.local_slices(rank, spec.shape)
        if box == t.ranges == spec.new.local_slices(rank, spec.shape):
            src, _ = _old_shard(schedule, t.tensor, rank, local_tensors)
            if src.device == device:
                out[t.tensor] = src
    return out


def _payload(schedule: FusedSchedule, msg: Message, rank: int, local_tensors) -> torch.Tensor:
    """The send buffer of ``msg``: the box itself when it is contiguous, else a packed copy."""
    parts = []
    for t in msg.boxes:
        src, origin = _old_shard(schedule, t.tensor, rank, local_tensors)
        parts.append(_view(src, t.ranges, origin))
    if len(parts) == 1:
        return parts[0].reshape(-1) if parts[0].is_contiguous() else parts[0].contiguous().reshape(-1)
    return torch.cat([p.reshape(-1) for p in parts])


def _landing(out: dict[str, torch.Tensor], new_origin, msg: Message) -> torch.Tensor | None:
    """The receive buffer of a one-box message when its target region is contiguous, else None."""
    if len(msg.boxes) != 1:
        return None
    t = msg.boxes[0]
    target = _view(out[t.tensor], t.ranges, new_origin[t.tensor])
    return target.view(-1) if target.is_contiguous() else None


def _describe(works, pending: list[str], rank: int) -> list[str]:
    """One description per work: NCCL coalesces a whole batch into one work."""
    if len(works) == len(pending):
        return pending
    return [f"the {len(pending)} sends/receives of rank {rank}"] * len(works)


def _wait_all(works, deadline: float, polled: bool, pending: list[str]) -> None:
    """Wait for ``works`` by ``deadline``: gloo's ``wait(timeout)``, or (``polled``: NCCL)
    polling completion, since NCCL's ``wait`` only orders streams."""
    for work, what in zip(works, pending):
        remaining = deadline - time.monotonic()
        try:
            if not polled:
                if remaining <= 0 and not work.is_completed():
                    raise ReshardTimeoutError(f"{what} not done by the deadline")
                work.wait(timeout=datetime.timedelta(seconds=max(remaining, 0.001)))
            else:
                while not work.is_completed():
                    if time.monotonic() > deadline:
                        raise ReshardTimeoutError(f"{what} not done by the deadline")
                    time.sleep(_POLL_S)
        except ReshardTimeoutError:
            raise
        except RuntimeError as exc:
            if "timed out" in str(exc).lower() or "timeout" in str(exc).lower():
                raise ReshardTimeoutError(f"{what} timed out: {exc}") from exc
            raise ReshardCommError(f"{what} failed: {exc}") from exc


def _wait_abortable(works, deadline: float, polled: bool, pending: list[str],
                    should_abort: Callable[[], bool], poll_s: float, rank: int) -> None:
    """``_wait_all`` on a helper thread; ``ReshardAborted`` as soon as ``should_abort()``."""
    done, error = threading.Event(), []

    def wait() -> None:
        try:
            _wait_all(works, deadline, polled, pending)
        except BaseException as exc:  # noqa: BLE001 - re-raised by the caller's thread
            error.append(exc)
        done.set()

    threading.Thread(target=wait, name=f"bsr-wait-{rank}", daemon=True).start()
    while not done.wait(poll_s):
        if should_abort():
            raise ReshardAborted(f"rank {rank}: exchange abandoned with {len(works)} "
                                 f"transfer(s) pending: a newer plan was published")
        if time.monotonic() > deadline + 1.0:  # the helper's own deadline passed long ago
            raise ReshardTimeoutError(f"rank {rank}: {len(works)} transfer(s) not done by the "
                                      "deadline")
    if error:
        raise error[0]


def execute_fused(
    schedule: FusedSchedule,
    rank: int,
    local_tensors: Mapping[str, torch.Tensor],
    device: torch.device | str = "cpu",
    timeout_s: float = 60.0,
    group: dist.ProcessGroup | None = None,
    should_abort: Optional[Callable[[], bool]] = None,
    poll_s: float = ABORT_POLL_S,
    comms_aborted: Optional[Callable[[], Optional[str]]] = None,
) -> tuple[dict[str, torch.Tensor], ExchangeStats]:
    """Execute ``schedule`` as ``rank``; return this rank's new shards by name and its stats.

    ``local_tensors`` maps a tensor name to this rank's old shard (needed where it sends or copies).
    ``should_abort`` (checked before posting and every ``poll_s`` while waiting) abandons the
    exchange with ``ReshardAborted``. ``comms_aborted`` (``GroupFormer.comms_aborted``) says
    why the group's communicators were aborted, if they were: on NCCL an aborted transfer
    completes as a success on partial data, so an exchange whose waits completed while it says
    so raises ``ReshardCommError`` instead of returning shards.
    """
    if should_abort is not None and should_abort():
        raise ReshardAborted(f"rank {rank}: exchange not started: a newer plan was published")
    start = time.monotonic()
    deadline = start + timeout_s
    stats = ExchangeStats(rank=rank)
    device = torch.device(device)
    out: dict[str, torch.Tensor] = {}
    new_origin: dict[str, tuple[int, ...]] = {}
    rebound = _unmoved(schedule, rank, local_tensors, device)
    for spec in schedule.specs:
        ranges = spec.new.local_slices(rank, spec.shape)
        if ranges is not None:
            new_origin[spec.name] = _origin(ranges)
            if spec.name in rebound:
                out[spec.name] = rebound[spec.name]  # same box, same device: rebind, no copy
            else:
                shape = tuple(hi - lo for lo, hi in ranges)
                out[spec.name] = torch.empty(shape, dtype=getattr(torch, spec.dtype), device=device)

    ops: list[dist.P2POp] = []
    pending: list[str] = []
    staged: list[tuple[torch.Tensor, Message]] = []
    for msg in schedule.messages_of(rank):
        if msg.src == rank:
            buf = _payload(schedule, msg, rank, local_tensors).to(device)
            ops.append(dist.P2POp(dist.isend, buf, msg.dst, group=group, tag=msg.tag))
            pending.append(f"send of {msg.numel} x {msg.dtype} from rank {rank} to rank {msg.dst}")
            stats.bytes_sent[msg.dst] = stats.bytes_sent.get(msg.dst, 0) + msg.nbytes
        else:
            buf = _landing(out, new_origin, msg)
            if buf is None:
                buf = torch.empty(msg.numel, dtype=getattr(torch, msg.dtype), device=device)
                staged.append((buf, msg))
            ops.append(dist.P2POp(dist.irecv, buf, msg.src, group=group, tag=msg.tag))
            pending.append(f"receive of {msg.numel} x {msg.dtype} at rank {rank} from rank {msg.src}")
            stats.bytes_received[msg.src] = stats.bytes_received.get(msg.src, 0) + msg.nbytes
    stats.messages = len(ops)
    packed = time.monotonic()
    stats.pack_s = packed - start

    works = []
    if ops:
        try:
            works = dist.batch_isend_irecv(ops)
        except RuntimeError as exc:
            raise ReshardCommError(f"rank {rank}: posting {len(ops)} sends/receives failed: {exc}") from exc
    # Local copies overlap the transfers in flight.
    for t in schedule.local_of(rank):
        if t.tensor in rebound:
            continue
        src, origin = _old_shard(schedule, t.tensor, rank, local_tensors)
        _view(out[t.tensor], t.ranges, new_origin[t.tensor]).copy_(_view(src, t.ranges, origin))
        stats.bytes_copied_locally += t.nbytes

    copied = time.monotonic()
    stats.local_s = copied - packed
    polled = device.type == "cuda" or (dist.is_initialized() and
                                       completes_at_enqueue(dist.get_backend(group)))
    pending = _describe(works, pending, rank)
    if works and should_abort is not None:
        _wait_abortable(works, deadline, polled, pending, should_abort, poll_s, rank)
    elif works:
        _wait_all(works, deadline, polled, pending)
    if polled:  # complete: on this thread's stream, the unpacking now follows the transfers
        for work, what in zip(works, pending):
            try:
                work.wait()
            except RuntimeError as exc:
                raise ReshardCommError(f"{what} failed: {exc}") from exc
    reason = comms_aborted() if comms_aborted is not None and works else None
    if reason is not None:
        raise ReshardCommError(f"rank {rank}: {len(works)} transfer(s) completed only because "
                               f"the communicators were aborted ({reason}); the exchange is "
                               "discarded")
    communicated = time.monotonic()
    stats.comm_s = communicated - packed

    for buf, msg in staged:
        at = 0
        for t in msg.boxes:
            target = _view(out[t.tensor], t.ranges, new_origin[t.tensor])
            target.copy_(buf[at : at + t.numel].view(target.shape))
            at += t.numel
    stats.unpack_s = time.monotonic() - communicated
    stats.total_s = time.monotonic() - start
    return out, stats
