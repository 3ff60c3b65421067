"""Training a patched tiny Llama inside PyTorch's distributed engines, run in each rank: FSDP2
(``fully_shard``), DDP and tensor parallelism (``ColwiseParallel`` lm_head). Each must give, step
by step, the global loss and metrics of one process training the unpatched model on the whole
batch, and the same parameters at the end.

Imported by tests/test_engines.py (gloo, CPU processes) and scripts/distributed_check.py (NCCL).

The data-parallel recipe (README, "FSDP2, DDP and tensor parallelism"): each rank takes its rows
of the batch, passes ``num_items_in_batch`` = the valid labels of the whole batch, and scales
its loss by the world size before the backward, since DDP and FSDP2 average the gradients over
ranks; the global loss is the all-reduced sum of the ranks' losses, the metrics come from
``token_metrics`` (sums over ranks, then ratios).
"""

import functools
import warnings

import torch
import torch.distributed as dist
from _tiny import logits_metrics, tiny_batch, tiny_causal_lm

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
    loss's operators (torch's CommDebugMode), by name."""
    from torch.distributed.tensor.debug import CommDebugMode

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
        with warnings.catch_warnings(), CommDebugMode() as comm:
            warnings.simplefilter("ignore", UserWarning)  # CommDebugMode's module hooks on non-tensor outputs
            out = wrapped(**batch, num_items_in_batch=num_items, return_metrics=True)
            # DDP and FSDP2 average the gradients over ranks; tensor parallelism's ranks share one batch
            (out.loss * (world if split_batch else 1)).backward()
        collectives.append({str(op): n for op, n in comm.get_comm_counts().items()})
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
