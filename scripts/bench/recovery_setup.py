"""What ``scripts/bench_recovery`` runs: the job's shape and the two setups it measures.

``DP`` (the default): a small float32 decoder that fits every device, so the planner picks data
parallelism and a switch moves no state. ``MOVING`` (``--state-moves``): a decoder whose state
(weights plus AdamW moments, about 138 MB) does not fit one device as the agents declare it
(``--hspmd-device-memory``), so every plan shards it (TP and/or PP) and a worker's loss changes
the layout: the switch moves tens of MB by fused BSR. Both run 2 nodes x 2 workers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

NODES = ("node0", "node1")
NPROC = 2
LEASE_TTL_S = 2.0
AFTER_KILL_STEPS = 4  # steps the job trains after the fault
WORKER_TIMEOUT_S = 30.0  # each runtime wait in the elastic script
SEED, DATA_SEED = 0, 0


@dataclass(frozen=True)
class Setup:
    model: dict  # ModelConfig fields
    global_batch: int
    section: str  # the docs/benchmarks.md section the report replaces
    device_memory: Optional[str] = None  # --hspmd-device-memory of the elastic agents
    run_timeout_s: float = 150.0  # one job, start to exit

    @property
    def params(self) -> int:
        from hspmd_elastic.graph.config import ModelConfig, param_specs

        total = 0
        for spec in param_specs(ModelConfig(**self.model)).values():
            n = 1
            for d in spec.shape:
                n *= d
            total += n
        return total


DP = Setup(dict(vocab_size=256, hidden_size=64, num_heads=4, num_layers=4, ffn_size=128,
                seq_len=32, dtype="float32"), 16, "## Recovery")
# A large vocabulary puts most of the state in the embedding (a lookup: cheap on CPU) and the
# head; 11.5 M parameters, 138 MB of weights and AdamW moments, about 184 MB per replica with
# gradients: 128 MiB per device makes the planner shard every replica.
MOVING = Setup(dict(vocab_size=40960, hidden_size=128, num_heads=4, num_layers=4, ffn_size=512,
                    seq_len=16, dtype="float32"), 8, "## Recovery when state moves", "128MiB",
                run_timeout_s=480.0)  # restart mode saves 138 MB after every step
