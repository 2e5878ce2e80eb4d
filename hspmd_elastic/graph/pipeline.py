"""The 1F1B pipeline schedule and its execution on one stage.

``one_f_one_b(stages, stage, microbatches)`` is pure: the order of forward and backward passes one
stage runs. ``peers`` is pure too: who sends activations to whom between two stages. Activations
are duplicated inside a TP group, so moving them between stages of different TP degree (the
activation reshard dup -> dup) only needs a sender per receiver: receiver ``j`` of the next stage
takes rank ``j mod tp_prev``'s copy; gradients flow back the same way. ``run_schedule`` is the
effect: it executes the schedule with point-to-point sends that complete by the end of the step
and receives that wait (with the comm's deadline) only when their data is needed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

FORWARD, BACKWARD = "F", "B"


def one_f_one_b(num_stages: int, stage: int, num_microbatches: int) -> list[tuple[str, int]]:
    """Warm-up forwards, then alternate one forward / one backward, then drain the backwards."""
    warmup = min(num_stages - stage - 1, num_microbatches)
    ops = [(FORWARD, m) for m in range(warmup)]
    for i in range(num_microbatches - warmup):
        ops += [(FORWARD, warmup + i), (BACKWARD, i)]
    ops += [(BACKWARD, m) for m in range(num_microbatches - warmup, num_microbatches)]
    return ops


def senders_to(receiver_index: int, sender_group: tuple[int, ...]) -> int:
    """The device of ``sender_group`` whose copy the receiver at ``receiver_index`` takes."""
    return sender_group[receiver_index % len(sender_group)]


def receivers_from(sender_index: int, sender_group: tuple[int, ...],
                   receiver_group: tuple[int, ...]) -> list[int]:
    """The devices of ``receiver_group`` that take the copy of the sender at ``sender_index``."""
    return [d for j, d in enumerate(receiver_group) if j % len(sender_group) == sender_index]


@dataclass(frozen=True)
class StageLinks:
    """This rank's neighbours: who it receives from and sends to, in each direction."""

    recv_activation: Optional[int]  # None on the first stage
    send_activation: tuple[int, ...]  # empty on the last stage
    recv_gradient: Optional[int]  # None on the last stage
    send_gradient: tuple[int, ...]  # empty on the first stage

    @classmethod
    def of(cls, stages: list[tuple[int, ...]], stage: int, tp_rank: int) -> "StageLinks":
        prev = stages[stage - 1] if stage > 0 else None
        nxt = stages[stage + 1] if stage + 1 < len(stages) else None
        return cls(
            recv_activation=None if prev is None else senders_to(tp_rank, prev),
            send_activation=() if nxt is None else tuple(receivers_from(tp_rank, stages[stage], nxt)),
            recv_gradient=None if nxt is None else senders_to(tp_rank, nxt),
            send_gradient=() if prev is None else tuple(receivers_from(tp_rank, stages[stage], prev)),
        )


def _tag(microbatch: int, direction: str) -> int:
    return 2 * microbatch + (0 if direction == FORWARD else 1)


def run_schedule(schedule, links: StageLinks, comm, *, forward: Callable, loss_of: Callable,
                 activation_shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> torch.Tensor:
    """Execute ``schedule`` on this stage; returns the sum of this stage's micro-batch losses.

    ``forward(m, x)`` runs the stage on micro-batch ``m`` (``x`` is None on the first stage);
    ``loss_of(m, out)`` turns the last stage's output into the weighted loss to backpropagate.
    Receive buffers and the loss live on ``device``.
    """
    inputs: dict[int, torch.Tensor] = {}
    outputs: dict[int, torch.Tensor] = {}
    total = torch.zeros((), dtype=dtype, device=device)
    for direction, m in schedule:
        if direction == FORWARD:
            x = None
            if links.recv_activation is not None:
                x = comm.recv(torch.empty(activation_shape, dtype=dtype, device=device),
                              links.recv_activation,
                              _tag(m, FORWARD)).requires_grad_(True)
            out = forward(m, x)
            if links.recv_gradient is None:
                out = loss_of(m, out)
                total = total + out.detach()
            for dst in links.send_activation:
                comm.send(out.detach(), dst, _tag(m, FORWARD))
            inputs[m], outputs[m] = x, out
        else:
            x, out = inputs.pop(m), outputs.pop(m)
            if links.recv_gradient is None:
                out.backward()
            else:
                grad = comm.recv(torch.empty(activation_shape, dtype=dtype, device=device),
                                 links.recv_gradient, _tag(m, BACKWARD))
                torch.autograd.backward(out, grad)
            for dst in links.send_gradient:
                comm.send(x.grad, dst, _tag(m, BACKWARD))
    comm.flush_sends()
    return total
