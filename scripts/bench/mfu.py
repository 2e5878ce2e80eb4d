"""``scripts/bench_step --mfu``: our one-device training step against transformers' Llama step.

One process, one device (``cuda:0``, or the CPU to rehearse). The same model trains twice, with
the same shape, batch, micro-batches and optimizer hyperparameters, and the same initial weights:

* **ours**: the specialized graph of a one-device plan, stepped as the runtime steps it
  (``Held.train_step``: SDPA attention, the loss in float32 from bf16 logits, the foreach
  ``ShardedAdamW``, the one-step undo copy where ``--undo`` says, on the device by default);
* **transformers**: ``LlamaForCausalLM`` with ``attn_implementation="sdpa"`` and
  ``torch.optim.AdamW(fused=True)`` (on the CPU: torch's default AdamW), the micro-batches
  accumulated into one optimizer step, the loss computed exactly as ours (float32 cross-entropy
  summed over the micro-batch's tokens, divided by the global batch's tokens). Its Hub kernels
  are off (``hub_kernels_off``): ``USE_HUB_KERNELS=0`` before transformers is imported and
  ``use_kernels=False`` (as a keyword where the constructor takes it, else on the model), so it
  runs transformers' own layers, never fetches a kernel from the Hub, and the report says so.

Both run under ``torch.autocast(<device>, torch.bfloat16)`` with float32 parameters (the master
weights), gradients and AdamW moments. The transformers model is built once, directly on the
device (``with torch.device(device)``, its own initialiser); ours is allocated on the device and
takes a copy of those tensors, name by name (``hf.weights.hf_names``), shapes checked. Parameter
counts are printed and must be equal. The two first-step losses (same weights, same batch) must
agree to 2% (bf16 rounding is far below that), else the run fails.

Reported per model: the median step time over ``--steps`` steps after ``--warmup`` warm-up steps,
tokens/s, achieved model TFLOP/s, MFU (over the device's dense bf16 peak: the planner's table for
the GPU's name, or ``--peak-tflops``), and the peak device memory that run allocated (the
parameters of the other model, resident meanwhile, are not counted). Then the ratio of ours to
transformers' tokens/s and whether the targets are met: ratio >= 0.95 on a GPU, and MFU >= 40 %
for the ``0.7b`` model on an H100/H200-class GPU. Targets are printed, never enforced.

Model FLOPs per token (``model_flops``, the one formula for both): 6 x the matrix parameters
(every 2-D weight the matrix products use: attention projections with key/value sized by
``num_kv_heads``, MLP, the LM head; not the embedding lookup; a tied head is counted once as the
LM head) plus causal attention as computed: for each layer, the score (QK^T) and value (PV)
products over the causal triangle only, query i against keys 0..i, i.e. ``s (s + 1) / 2``
pairs per head per sequence of ``s`` tokens, each pair ``2 x head_dim`` FLOPs per product;
per token and layer that is ``2 x 2 x hidden x (s + 1) / 2`` forward, times 3 for forward and
backward: ``6 x layers x hidden x (s + 1)``. Norms, RoPE, softmax, SiLU, the loss and the
optimizer are not counted; neither is attention's recomputation in a flash backward.

Output: progress lines on stderr while it runs, the Markdown report on stdout (``--out`` also
writes it to a file, ``--json`` the numbers). Exit 1 after one ``bench_step: FAIL: ...`` line, the
last on stderr, when transformers is missing, the parameter counts differ, a loss is not finite,
the first-step losses disagree, or the device runs out of memory.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import inspect
import json
import math
import os
import statistics
import sys
import time
from typing import Callable

import torch
import torch.nn.functional as F

from hspmd_elastic.files import atomic_write
from hspmd_elastic.graph.config import ModelConfig, param_specs
from hspmd_elastic.graph.optim import AdamWConfig

# float32 master weights, bf16 compute. "0.7b": 0.75 B parameters (embedding included).
SIZES = {
    "0.7b": dict(vocab_size=32000, hidden_size=2048, num_heads=16, num_layers=12, ffn_size=5632,
                 seq_len=2048, dtype="float32", compute_dtype="bfloat16"),
    "tiny": dict(vocab_size=256, hidden_size=64, num_heads=4, num_layers=2, ffn_size=128,
                 seq_len=32, dtype="float32", compute_dtype="bfloat16"),
}
BATCH = {"0.7b": (16, 4), "tiny": (8, 2)}  # global batch (rows), micro-batches
OPTIM = AdamWConfig(lr=3e-4)  # both models: lr, betas, eps and weight decay of this
RATIO_TARGET = 0.95
MFU_TARGET = 0.40
MFU_TARGET_GPUS = ("H100", "H200", "H800")  # planner types and their variants (H100-PCIE, ...)
LOSS_AGREEMENT = 0.02
HUB_KERNELS_ENV = "USE_HUB_KERNELS"  # transformers' switch for the kernels package's layers


class BenchFailed(Exception):
    """One line: why the benchmark cannot give numbers."""


def model_flops(config: ModelConfig) -> dict:
    """Model FLOPs per token of one training step (module docstring): the matrix parameters,
    the causal attention term and their total ``6 x matrix + attention``."""
    specs = param_specs(config)
    matrix = sum(math.prod(s.shape) for name, s in specs.items()
                 if len(s.shape) == 2 and name != "embed.weight")
    if config.tie_embeddings:  # the head multiplies by the embedding table
        matrix += config.vocab_size * config.hidden_size
    attention = 6.0 * config.num_layers * config.hidden_size * (config.seq_len + 1)
    return {"matrix_params": matrix, "attention_per_token": attention,
            "per_token": 6.0 * matrix + attention}


def _transformers():
    try:
        import transformers
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as exc:
        raise BenchFailed(f"the baseline needs transformers (pip install 'transformers>=5'): "
                          f"{exc}") from None
    return transformers.__version__, LlamaConfig, LlamaForCausalLM


def build_transformers(config: ModelConfig, device: torch.device):
    """``LlamaForCausalLM`` of ``config``'s shape, initialised once, on ``device``, float32."""
    from hspmd_elastic.hf.config import config_to_hf

    _version, LlamaConfig, LlamaForCausalLM = _transformers()
    hf_config = LlamaConfig(**config_to_hf(config, dtype="float32"), attn_implementation="sdpa")
    hf_config.use_cache = False
    # transformers 5 can swap layers (RMSNorm, ...) for kernels from the Hub: not in the baseline
    accepted = inspect.signature(LlamaForCausalLM.__init__).parameters
    off = {"use_kernels": False} if "use_kernels" in accepted else {}
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(hf_config, **off)
    hub_kernels_off(model)
    if model.config._attn_implementation != "sdpa":
        raise BenchFailed(f"transformers chose attention {model.config._attn_implementation!r}, "
                          "not 'sdpa'")
    return model.to(torch.float32).train()


def hub_kernels_off(model) -> str:
    """Turn transformers' Hub kernels off on ``model`` where they are on (``use_kernels``; a
    transformers without them has nothing to turn off) and say which layers ``model`` runs:
    ``off (...)``, or ``ON for N layer(s): ...`` when a layer's forward is still replaced."""
    if not hasattr(model, "use_kernels"):
        return f"none (transformers {_transformers()[0]} has no Hub kernels)"
    if model.use_kernels:
        model.use_kernels = False
    swapped = sorted(name for name, m in model.named_modules() if "forward" in vars(m))
    if model.use_kernels or swapped:
        return (f"ON for {len(swapped)} layer(s): {', '.join(swapped[:3]) or '?'}"
                + (", ..." if len(swapped) > 3 else ""))
    return (f"off (use_kernels=False, {HUB_KERNELS_ENV}="
            f"{os.environ.get(HUB_KERNELS_ENV, 'unset')}; transformers' own layers)")


def parameter_count(params) -> int:
    seen, total = set(), 0
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


def build_ours(config: ModelConfig, device: torch.device, global_batch: int, microbatches: int,
               hf_model, undo: str):
    """Our one-device step (``Held``), its parameters copied from ``hf_model``'s (no init)."""
    from hspmd_elastic.graph.comm import Comm
    from hspmd_elastic.graph.specialize import SpecializedModel
    from hspmd_elastic.hf.weights import hf_names
    from hspmd_elastic.plan import simple_plan
    from hspmd_elastic.switch import Held

    plan = simple_plan(num_layers=config.num_layers, global_batch=global_batch,
                       num_microbatches=microbatches)
    model = SpecializedModel(config, plan, 0, Comm.create(plan, config, 0, device=device), OPTIM)
    theirs = dict(hf_model.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for name, hf_name in hf_names(config).items():
            ours, source = model.params[name], theirs.get(hf_name)
            if source is None or tuple(source.shape) != tuple(ours.shape):
                raise BenchFailed(f"parameter {name}: ours {tuple(ours.shape)}, transformers' "
                                  f"{hf_name} {None if source is None else tuple(source.shape)}")
            ours.copy_(source)
    return Held(1, plan, [], model, undo_mode=undo)


def ours_step(held, sample, global_batch: int) -> Callable[[int], float]:
    """Step ``i`` as the runtime runs it: the rank's rows of the global batch, ``train_step``."""
    from hspmd_elastic.runtime import rows_at

    rows = held.model.batch_rows()
    return lambda i: held.train_step(rows_at(sample, i, global_batch, rows))


def transformers_step(model, config: ModelConfig, device: torch.device, global_batch: int,
                      microbatches: int, sample) -> Callable[[int], float]:
    from hspmd_elastic.graph.model import compute_context
    from hspmd_elastic.runtime import global_batch_at

    fused = {"fused": True} if device.type == "cuda" else {}
    opt = torch.optim.AdamW(model.parameters(), lr=OPTIM.lr, betas=OPTIM.betas, eps=OPTIM.eps,
                            weight_decay=OPTIM.weight_decay, **fused)
    tokens = global_batch * config.seq_len

    def step(i: int) -> float:
        batch = global_batch_at(sample, i, global_batch).to(device, non_blocking=True)
        opt.zero_grad(set_to_none=True)
        total = torch.zeros((), device=device)
        for chunk in batch.chunk(microbatches):
            with compute_context(config, device):
                logits = model(input_ids=chunk[:, :-1], use_cache=False).logits
            loss = F.cross_entropy(logits.float().reshape(-1, config.vocab_size),
                                   chunk[:, 1:].reshape(-1), reduction="sum") / tokens
            loss.backward()
            total += loss.detach()
        opt.step()
        return float(total)

    return step


@contextlib.contextmanager
def sdpa_calls(record: list):
    """Record (is_causal, mask given) of every SDPA call while inside (as called: a flash
    kernel needs causal without a mask)."""
    real = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *args, **kwargs):
        record.append((bool(is_causal), attn_mask is not None))
        return real(q, k, v, attn_mask, dropout_p, is_causal, *args, **kwargs)

    F.scaled_dot_product_attention = spy
    try:
        yield
    finally:
        F.scaled_dot_product_attention = real


def _timed(step: Callable[[int], float], sync: Callable[[], None], warmup: int,
           steps: int) -> tuple[float, list[float], list]:
    """Median seconds of ``step(i)`` after ``warmup`` calls, every loss, and the SDPA calls of
    the first step."""
    times, losses, calls = [], [], []
    for i in range(warmup + steps):
        sync()
        start = time.perf_counter()
        with (sdpa_calls(calls) if i == 0 else contextlib.nullcontext()):
            losses.append(step(i))
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times), losses, calls


def _attention(calls: list) -> str:
    kinds = sorted({("causal" if c else "not causal") + (" with a mask" if m else ", no mask")
                    for c, m in calls})
    return f"{len(calls)} SDPA calls ({'; '.join(kinds) or 'none'})"


def progress(line: str) -> None:
    """A line while the benchmark runs (stderr: stdout is the report alone)."""
    print(line, file=sys.stderr, flush=True)


def run(args) -> int:
    """The ``--mfu`` benchmark; 0, or 1 after one ``bench_step: FAIL: ...`` line on stderr."""
    try:
        return _run(args)
    except BenchFailed as exc:
        print(f"bench_step: FAIL: {exc}", file=sys.stderr, flush=True)
    except torch.cuda.OutOfMemoryError as exc:
        print(f"bench_step: FAIL: out of device memory ({str(exc).splitlines()[0][:200]}); "
              "try --global-batch with more --microbatches", file=sys.stderr, flush=True)
    return 1


def _run(args) -> int:
    from hspmd_elastic.planner import spec_for_device
    from hspmd_elastic.planner.devices import known_type, spec_table
    from hspmd_elastic.runtime import synthetic_sampler

    os.environ[HUB_KERNELS_ENV] = "0"  # before transformers is imported (5.x reads it then)
    hf_version = _transformers()[0]  # fail first, in one line, when it is missing
    name = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device("cuda:0" if name == "cuda" else name)
    except RuntimeError:
        raise BenchFailed(f"--device {name!r} is not a device; valid: cuda, cuda:N, cpu") from None
    on_cuda = device.type == "cuda"
    if device.type not in ("cuda", "cpu"):
        raise BenchFailed(f"--device {name!r}: the benchmark runs on cuda or cpu")
    if on_cuda and not torch.cuda.is_available():
        raise BenchFailed(f"--device {name}: torch {torch.__version__} cannot use CUDA")
    if args.steps < 1 or args.warmup < 0:
        raise BenchFailed(f"--steps {args.steps} --warmup {args.warmup}: need steps >= 1 and "
                          "warmup >= 0")
    config = ModelConfig(**SIZES[args.size])
    global_batch, microbatches = BATCH[args.size]
    global_batch = args.global_batch or global_batch
    microbatches = args.microbatches or microbatches
    if global_batch % microbatches:
        raise BenchFailed(f"--global-batch {global_batch} is not divisible by --microbatches "
                          f"{microbatches}")
    gpu = torch.cuda.get_device_name(device) if on_cuda else "CPU"
    if on_cuda:
        torch.cuda.set_device(device)
    peak = args.peak_tflops or spec_for_device(gpu).peak_tflops
    sync = (lambda: torch.cuda.synchronize(device)) if on_cuda else (lambda: None)
    allocated = (lambda: torch.cuda.memory_allocated(device)) if on_cuda else (lambda: 0)
    sample = synthetic_sampler(config, 0)
    tokens = global_batch * config.seq_len
    flops = model_flops(config)

    hf_model = build_transformers(config, device)
    kernels = hub_kernels_off(hf_model)
    progress(f"transformers baseline: hub kernels: {kernels}")
    hf_params = allocated()  # transformers' parameters, resident while ours runs
    held = build_ours(config, device, global_batch, microbatches, hf_model, args.undo)
    counts = {"ours": parameter_count(held.model.params.values()),
              "transformers": parameter_count(hf_model.parameters())}
    progress(f"parameters: ours {counts['ours']:,}, transformers {counts['transformers']:,}")
    if counts["ours"] != counts["transformers"]:
        raise BenchFailed(f"parameter counts differ: ours {counts['ours']:,}, transformers "
                          f"{counts['transformers']:,}")
    undo = "no undo copy" if args.undo == "off" else f"undo copy on the {args.undo}"
    labels = {"ours": f"ours: specialized step (SDPA, foreach AdamW, {undo})",
              "transformers": "transformers LlamaForCausalLM (SDPA, "
                              + ("fused AdamW)" if on_cuda else "AdamW)")}
    runs, rows = {}, []

    def measure(key: str, step: Callable[[int], float], resident: int) -> None:
        """Time ``step``; ``resident``: device bytes allocated by the other model meanwhile."""
        if on_cuda:
            torch.cuda.reset_peak_memory_stats(device)
        seconds, losses, calls = _timed(step, sync, args.warmup, args.steps)
        peak_mem = torch.cuda.max_memory_allocated(device) - resident if on_cuda else 0
        if not all(math.isfinite(x) for x in losses):
            raise BenchFailed(f"{key}: a loss is not finite: {losses}")
        rate = tokens / seconds
        achieved = rate * flops["per_token"] / 1e12
        runs[key] = {"label": labels[key], "step_s": seconds, "tokens_per_s": rate,
                     "achieved_tflops": achieved, "mfu": achieved / peak,
                     "peak_memory_bytes": peak_mem, "losses": losses,
                     "attention": _attention(calls)}
        memory = f"{peak_mem / 2**30:.1f}" if on_cuda else "-"
        rows.append(f"| {labels[key]} | {seconds * 1000:.1f} | {rate:,.0f} | {achieved:.3g} "
                    f"| {100 * achieved / peak:.1f}% | {memory} |")
        progress(rows[-1])

    step = ours_step(held, sample, global_batch)
    del held
    measure("ours", step, resident=hf_params)
    del step  # ours' state, moments and undo copy leave the device before transformers runs
    gc.collect()
    if on_cuda:
        torch.cuda.empty_cache()
    measure("transformers", transformers_step(hf_model, config, device, global_batch,
                                              microbatches, sample),
            resident=allocated() - hf_params)
    first = runs["ours"]["losses"][0], runs["transformers"]["losses"][0]
    if abs(first[0] - first[1]) > LOSS_AGREEMENT * abs(first[1]):
        raise BenchFailed(f"first-step losses disagree: ours {first[0]:.5f}, transformers "
                          f"{first[1]:.5f} (same weights and batch; allowed {LOSS_AGREEMENT:.0%})")
    ratio = runs["ours"]["tokens_per_s"] / runs["transformers"]["tokens_per_s"]
    targets = _targets(on_cuda, args.size, known_type(gpu, spec_table()), ratio,
                       runs["ours"]["mfu"])
    report = "\n".join([
        f"MFU on {gpu} ({device}), torch {torch.__version__}, transformers {hf_version}, "
        f"measured {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}:"
        f" model `{args.size}` ({counts['ours']:,} parameters in both, "
        f"{json.dumps(SIZES[args.size])}), global batch {global_batch} x {config.seq_len} tokens "
        f"in {microbatches} micro-batches (gradient accumulation), bf16 autocast with float32 "
        f"master weights, AdamW lr {OPTIM.lr:g}; median of {args.steps} steps after "
        f"{args.warmup} warm-up. Model FLOPs {flops['per_token'] / 1e9:.4g} GFLOP per token "
        f"= 6 x {flops['matrix_params'] / 1e6:,.1f} M matrix parameters + "
        f"{flops['attention_per_token'] / 1e9:.4g} GFLOP causal attention (docs/gpu.md); peak "
        f"{peak:g} TFLOP/s (dense bf16).",
        "",
        "| step | step (ms) | tokens/s | achieved TFLOP/s | MFU | peak memory (GiB) |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
        f"ours / transformers tokens/s: {ratio:.3f}x. First-step loss (same weights and batch): "
        f"ours {first[0]:.5f}, transformers {first[1]:.5f}. Attention in the first step: ours "
        f"{runs['ours']['attention']}; transformers {runs['transformers']['attention']}.",
        f"targets: {targets['text']}",
        f"transformers baseline: hub kernels: {kernels}.",
        "",
    ])
    result = {"device": gpu, "size": args.size, "config": json.loads(config.to_json()),
              "global_batch": global_batch, "microbatches": microbatches, "peak_tflops": peak,
              "flops": flops, "flops_per_token": flops["per_token"], "parameters": counts,
              "torch": torch.__version__, "transformers": hf_version, "hub_kernels": kernels,
              "runs": runs,
              "ratio": ratio, "targets": targets}
    if args.out:
        atomic_write(args.out, report)
    if args.json:
        atomic_write(args.json, json.dumps(result, indent=1))
    print(report, flush=True)
    return 0


def _targets(on_cuda: bool, size: str, gpu_type, ratio: float, mfu: float) -> dict:
    """Whether each target is met (None: not judged here) and one line saying so."""
    if not on_cuda:
        return {"ratio_met": None, "mfu_met": None,
                "text": f"ours >= {RATIO_TARGET:g}x transformers' tokens/s and MFU >= "
                        f"{MFU_TARGET:.0%} apply on a GPU (not judged on the CPU)"}
    ratio_met = ratio >= RATIO_TARGET
    parts = [f"ours/transformers {ratio:.3f}x >= {RATIO_TARGET:g}x: "
             + ("met" if ratio_met else "NOT met")]
    mfu_met = None
    if size == "0.7b" and str(gpu_type).upper().split("-")[0] in MFU_TARGET_GPUS:
        mfu_met = mfu >= MFU_TARGET
        parts.append(f"MFU {100 * mfu:.1f}% >= {MFU_TARGET:.0%}: "
                     + ("met" if mfu_met else "NOT met"))
    else:
        parts.append(f"MFU >= {MFU_TARGET:.0%} applies to the 0.7b model on an H100/H200-class "
                     "GPU (not judged here)")
    return {"ratio_met": ratio_met, "mfu_met": mfu_met, "text": "; ".join(parts)}
