"""Functions run in spawned ranks (kept apart from the test modules so that a rank imports little):
``token_metrics`` over a group, ranks whose arguments disagree, and a patched tiny Llama trained
inside PyTorch's distributed engines.

The engines, FSDP2 (``fully_shard``), DDP and tensor parallelism (``ColwiseParallel`` lm_head),
must each give, step by step, the global loss and metrics of one process training the unpatched
model on the whole batch, and the same parameters at the end (``check_engine``, run by
tests/integrations/test_engines.py over gloo on CPU processes and by scripts/gpu_distributed.py
over NCCL). The data-parallel recipe (README, "FSDP2, DDP and tensor parallelism"): each rank
takes its rows of the batch, passes ``num_items_in_batch`` = the valid labels of the whole batch,
and scales its loss by the world size before the backward, since DDP and FSDP2 average the
gradients over ranks; the global loss is the all-reduced sum of the ranks' losses, the metrics
come from ``token_metrics`` (sums over ranks, then ratios).
"""

import functools
import os
import sys

import torch
import torch.distributed as dist
from _tiny import logits_metrics, tiny_batch, tiny_causal_lm
from torch.utils._python_dispatch import TorchDispatchMode


class CollectiveCounts(TorchDispatchMode):
    """Counts, by name ("c10d.allreduce_", "_c10d_functional.all_gather_into_tensor"), the collectives
    dispatched inside it: the count of torch's CommDebugMode without its module hooks, which fail on
    transformers 5.25's Llama (its rotary embedding is a hub layer called inside the attention's forward)."""

    NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional", "_c10d_functional_autograd")
    NOT_COLLECTIVES = ("wait_tensor", "barrier", "monitored_barrier")

    def __init__(self):
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in self.NAMESPACES and func.overloadpacket.__name__ not in self.NOT_COLLECTIVES:
            name = str(func.overloadpacket)
            self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def exit_without_teardown() -> None:
    """Ends a rank whose work is done and recorded without the interpreter's teardown, where
    gloo's threads now and then aborted the process ("terminate called without an active
    exception", no Python frame left) after everything had run and passed."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def token_metrics_on_rank(rank: int, store: str, results: str) -> None:
    """Rank ``rank`` of 2: ``token_metrics`` of its own sums, over a gloo group; saves the result."""
    from kernels import get_kernel

    flce = get_kernel("qgallouedec/fused-linear-ce", version=1, trust_remote_code=True)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        # rank 0: 1 of 2 tokens right, entropy 2; rank 1: 6 of 8 right, entropy 3
        counts = [(1, 2.0, 2), (6, 3.0, 8)][rank]
        metrics = {
            "num_correct_tokens": torch.tensor(counts[0]),
            "entropy_sum": torch.tensor(counts[1]),
            "num_valid_tokens": torch.tensor(counts[2]),
        }
        out = flce.token_metrics(metrics)  # default: all-reduce over the process group
        torch.save({k: v.item() for k, v in out.items()}, f"{results}.{rank}")
    finally:
        dist.destroy_process_group()


# ---- ranks that disagree: each case maps (rank, the agreeing call's arguments) to this rank's ----
VOCAB, HALF = 40, 20  # two ranks, 20 vocabulary rows each


def disagreement_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden [2, 16, 16], the whole weight [40, 16] and targets [2, 16] (a few ignored), the same on every rank."""
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 16, 16, generator=generator)
    weight = torch.randn(VOCAB, 16, generator=generator)
    targets = torch.randint(0, VOCAB, (2, 16), generator=generator)
    targets[:, ::5] = -100
    return hidden, weight, targets


def _on_rank1(rank: int, args: dict, **changes) -> dict:
    return {**args, **changes} if rank == 1 else args


def _with_target(targets: torch.Tensor, value: int) -> torch.Tensor:
    changed = targets.clone()
    changed[0, 1] = value
    return changed


DISAGREEMENTS = {
    "targets shifted by one position": lambda r, a: {**a, "targets": a["targets"].roll(r, dims=-1)},
    "one target": lambda r, a: _on_rank1(r, a, targets=_with_target(a["targets"], 7)),
    "return_lse": lambda r, a: _on_rank1(r, a, return_lse=True),
    "an overlapping vocab_start": lambda r, a: {**a, "vocab_start": [0, 15][r]},
    "an out-of-range vocab_start": lambda r, a: _on_rank1(r, a, vocab_start=VOCAB),
    "ignore_index": lambda r, a: _on_rank1(r, a, ignore_index=-1),
    "a bad target on one rank": lambda r, a: _on_rank1(r, a, targets=_with_target(a["targets"], VOCAB)),
    "a bad target on every rank": lambda r, a: {**a, "targets": _with_target(a["targets"], -5)},
    "N": lambda r, a: _on_rank1(r, a, hidden=a["hidden"][:, :-1], targets=a["targets"][:, :-1]),
    "the hidden dtype": lambda r, a: _on_rank1(r, a, hidden=a["hidden"].double(), weight=a["weight"].double()),
    "requires_grad": lambda r, a: _on_rank1(r, a, hidden=a["hidden"].detach()),
    "H": lambda r, a: _on_rank1(r, a, hidden=a["hidden"][..., :-1], weight=a["weight"][:, :-1]),
    "logit_scale by one ulp": lambda r, a: _on_rank1(r, a, logit_scale=1.0000000000000002),
    "softcap": lambda r, a: _on_rank1(r, a, softcap=30.0),
    "reduction": lambda r, a: _on_rank1(r, a, reduction="sum"),
    "return_metrics": lambda r, a: _on_rank1(r, a, return_metrics=True),
    "label_smoothing": lambda r, a: _on_rank1(r, a, label_smoothing=0.1),
    "z_loss_scale": lambda r, a: _on_rank1(r, a, z_loss_scale=1e-4),
    "shift": lambda r, a: _on_rank1(r, a, shift=1),
    "class_weight present": lambda r, a: _on_rank1(r, a, class_weight=torch.ones(VOCAB)),
    "class_weight's values": lambda r, a: {**a, "class_weight": torch.linspace(0.5, 1.5 + r, VOCAB)},
    "class_weight's requires_grad": lambda r, a: {**a, "class_weight": torch.ones(VOCAB, requires_grad=r == 1)},
    "bias": lambda r, a: _on_rank1(r, a, bias=torch.zeros(HALF, requires_grad=True)),
    # then the ranks agree again (the group is still in step): the loss of the whole vocabulary
    "agreeing ranks": lambda r, a: a,
    "agreeing slices in the other order": lambda r, a: {**a, "weight": disagreement_inputs()[1][[HALF, 0][r]:][:HALF],
                                                        "vocab_start": [HALF, 0][r]},
}


UNCHECKED = "agreeing ranks, unchecked"  # FLCE_CHECK_TARGETS=0: no check, the cached layout's all-gather


def disagreeing_ranks(rank: int, store: str, results: str) -> None:
    """Rank ``rank`` of 2 calls the loss once per case of DISAGREEMENTS, and for UNCHECKED
    (PyTorch backend), over a gloo group whose collectives time out after 20 s; after each case
    it saves every case's outcome so far to ``results.<rank>`` (json): ["raised", type, message]
    or ["returned", loss]."""
    import json
    from datetime import timedelta

    from kernels import get_kernel

    os.environ["TRITON_INTERPRET"] = "0"
    flce = get_kernel("qgallouedec/fused-linear-ce", version=1, trust_remote_code=True)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=20))
    hidden, weight, targets = disagreement_inputs()
    outcomes = {}
    settings = sys.modules[f"{flce.__name__}._settings"]
    for name, arguments_of in [*DISAGREEMENTS.items(), (UNCHECKED, DISAGREEMENTS["agreeing ranks"])]:
        agreeing = dict(hidden=hidden.clone().requires_grad_(),
                        weight=weight[rank * HALF:(rank + 1) * HALF].clone().requires_grad_(),
                        targets=targets, process_group=dist.group.WORLD)
        try:
            with settings.override(check_targets=name != UNCHECKED):
                out = flce.fused_linear_cross_entropy(**arguments_of(rank, agreeing))
            outcomes[name] = ["returned", (out[0] if isinstance(out, tuple) else out).sum().item()]
        except Exception as error:  # noqa: BLE001 (recorded, compared across the ranks by the test)
            outcomes[name] = ["raised", type(error).__name__, str(error)]
        with open(f"{results}.{rank}", "w") as f:
            json.dump(outcomes, f)
    dist.destroy_process_group()
    exit_without_teardown()


# ---- a patched tiny Llama trained inside FSDP2, DDP and tensor parallelism ----------------
STEPS = 3
LEARNING_RATE = 1e-2
ENGINES = {  # engine -> tiny_causal_lm arch
    "fsdp2": "llama",  # every decoder layer and lm_head a unit of their own, then the root
    "fsdp2-tied": "llama-tied",  # the tied embedding and lm_head one unit: fully_shard([embed, lm_head])
    "ddp": "llama-tied",
    "tp": "llama",  # lm_head ColwiseParallel(use_local_output=False); the same whole batch on every rank
}


def _batches(arch: str, device, rows: int) -> list[dict]:
    """Each step's whole batch: ``rows`` sequences, row 0 with a masked prompt, row 1 padded."""
    model = tiny_causal_lm(arch)
    batches = [tiny_batch(model, batch=rows, seed=step) for step in range(STEPS)]
    return [{k: v.to(device) for k, v in b.items()} for b in batches]


def _optimizer(model):
    # foreach=False: the same per-parameter arithmetic on plain tensors and DTensors
    return torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, foreach=False)


@functools.cache
def train_reference(arch: str, device, rows: int) -> tuple[list[dict], dict]:
    """One process, the unpatched model on the whole batch: per step the loss, token accuracy and
    mean entropy (from the logits, float64), and the final parameters by name."""
    model = tiny_causal_lm(arch).to(device)
    optimizer = _optimizer(model)
    history = []
    for batch in _batches(arch, device, rows):
        out = model(**batch)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        sums = logits_metrics(out.logits.detach(), batch["labels"])
        history.append({"loss": out.loss.item(),
                        "mean_token_accuracy": sums["num_correct_tokens"] / sums["num_valid_tokens"],
                        "entropy": sums["entropy_sum"] / sums["num_valid_tokens"]})
    return history, {name: p.detach().clone() for name, p in model.named_parameters()}


def _wrap(engine: str, model, device):
    """The model inside ``engine``, and whether each rank trains on its own rows of the batch."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(torch.device(device).type, (dist.get_world_size(),))
    if engine.startswith("fsdp2"):
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        if engine == "fsdp2-tied":
            fully_shard([model.model.embed_tokens, model.lm_head], mesh=mesh)
        else:
            fully_shard(model.lm_head, mesh=mesh)
        return fully_shard(model, mesh=mesh), True
    if engine == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=None if device == "cpu" else [torch.device(device)]), True
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    return parallelize_module(model, mesh, {"lm_head": ColwiseParallel(use_local_output=False)}), False


def _rows(world: int) -> int:
    return 2 * max(world, 2)  # two sequences a rank, unequal valid counts (prompt, padding)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def train_engine(flce, engine: str, device) -> tuple[list[dict], dict, list[dict]]:
    """The patched model trained inside ``engine``: per step the global loss and metrics, the
    final parameters (whole tensors) by name, and per step the collectives counted outside the
    loss's operators (``CollectiveCounts``), by name."""
    rank, world = dist.get_rank(), dist.get_world_size()
    arch = ENGINES[engine]
    model = flce.patch_forward(tiny_causal_lm(arch).to(device))
    wrapped, split_batch = _wrap(engine, model, device)
    optimizer = _optimizer(wrapped)
    history, collectives = [], []
    for batch in _batches(arch, device, _rows(world)):
        num_items = (batch["labels"][:, 1:] != -100).sum()  # the whole batch's, as the HF Trainer counts
        if split_batch:
            batch = {k: v.tensor_split(world)[rank] for k, v in batch.items()}
        with CollectiveCounts() as comm:
            out = wrapped(**batch, num_items_in_batch=num_items, return_metrics=True)
            # DDP and FSDP2 average the gradients over ranks; tensor parallelism's ranks share one batch
            (out.loss * (world if split_batch else 1)).backward()
        collectives.append(comm.counts)
        optimizer.step()
        optimizer.zero_grad()
        loss = out.loss.detach().clone()
        if split_batch:
            dist.all_reduce(loss)
        metrics = flce.token_metrics(out.metrics, None if split_batch else (lambda t: t))
        history.append({"loss": loss.item(), **{k: v.item() for k, v in metrics.items()}})
    params = {name: _full(p.detach()).clone() for name, p in model.named_parameters()}
    return history, params, collectives


def check_engine(flce, engine: str, device="cpu") -> None:
    """``train_engine`` against ``train_reference``, with fp32 tolerances."""
    history, params, collectives = train_engine(flce, engine, device)
    ref_history, ref_params = train_reference(ENGINES[engine], device, _rows(dist.get_world_size()))
    # fp32 sums over another grouping of the tokens (per rank, per vocabulary slice, fused);
    # on a GPU, fp32 matmuls and the kernel's 3xTF32 products
    rel = 1e-5 if device == "cpu" else 1e-4
    for step, (got, want) in enumerate(zip(history, ref_history, strict=True)):
        for key in ("loss", "mean_token_accuracy", "entropy"):
            assert abs(got[key] - want[key]) <= rel * abs(want[key]) + 1e-7, f"step {step} {key}: {got} != {want}"
    assert set(params) == set(ref_params)
    # STEPS AdamW steps move a parameter by up to LEARNING_RATE * STEPS (3e-2); from gradients
    # equal up to fp32 rounding the two runs differ by a few 1e-6 on the CPU (measured): 1e-4
    # is under 1/300 of the movement. On a GPU (3xTF32 in the kernel, other reduction orders)
    # Adam's normalisation can magnify a gradient's rounding where it is near 0: 1e-3.
    atol = 1e-4 if device == "cpu" else 1e-3
    for name, p in params.items():
        torch.testing.assert_close(p.cpu(), ref_params[name].cpu(), rtol=0, atol=atol,
                                   msg=lambda m, n=name: f"{engine} {n}: {m}")
    if engine == "tp":
        # Neither the logits nor the weight are gathered: outside the loss's operators a step's
        # only collective is the loss's all-reduce of the targets' fingerprint.
        for step, counts in enumerate(collectives):
            assert set(counts) <= {"c10d.allreduce_"}, f"step {step}: {counts}"
