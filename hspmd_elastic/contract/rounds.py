"""The job's round state, ``rdzv/state``: restart mode's rendezvous rounds and the record both
modes write when the job ends.

Promises:

* ``RoundState`` is ``rdzv/state`` as read (``mod_revision`` 0: absent), immutable; ``encode`` /
  ``decode`` go through the schema's ``RdzvStateRecord``, so the record is checked like any
  other;
* the states are ``JOINING``, ``CLOSED`` (restart mode's rounds) and ``SUCCEEDED``, ``FAILED``
  (``TERMINAL``: the job's end, written by restart mode's agents and by elastic mode's, each
  with a compare-and-set, and read by both to end together).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

from hspmd_elastic.contract import schema

JOINING, CLOSED, SUCCEEDED, FAILED = schema.RDZV_STATES
TERMINAL = (SUCCEEDED, FAILED)


@dataclass(frozen=True)
class Participant:
    """One node of a closed round (``RdzvParticipant`` as read)."""

    node: str
    host: str
    local_world_size: int
    node_rank: Optional[int] = None
    create_revision: int = 0


@dataclass(frozen=True)
class RoundState:
    """``rdzv/state`` as read (``mod_revision`` 0: absent), immutable."""

    round: int
    state: str
    restart_count: int
    participants: tuple[Participant, ...] = ()
    reason: str = ""
    at: float = 0.0
    mod_revision: int = 0

    def encode(self) -> bytes:
        return schema.encode(schema.RdzvStateRecord(
            round=self.round, state=self.state, restart_count=self.restart_count,
            participants=[schema.RdzvParticipant(**asdict(p)) for p in self.participants],
            reason=self.reason, at=self.at))

    @classmethod
    def decode(cls, key: str, raw: bytes, mod_revision: int) -> "RoundState":
        rec = schema.decode(key, raw)
        return cls(round=rec.round, state=rec.state, restart_count=rec.restart_count,
                   participants=tuple(Participant(**asdict(p)) for p in rec.participants),
                   reason=rec.reason, at=rec.at, mod_revision=mod_revision)

    def nodes(self) -> list[str]:
        return [p.node for p in self.participants]
