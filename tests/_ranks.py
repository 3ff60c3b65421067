"""Functions run in spawned ranks (kept apart from the test modules so that a rank imports little)."""

import os
import sys

import torch


def exit_without_teardown() -> None:
    """Ends a rank whose work is done and recorded without the interpreter's teardown, where
    gloo's threads now and then aborted the process ("terminate called without an active
    exception", no Python frame left) after everything had run and passed."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def token_metrics_on_rank(rank: int, store: str, results: str) -> None:
    """Rank ``rank`` of 2: ``token_metrics`` of its own sums, over a gloo group; saves the result."""
    import torch.distributed as dist
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

    import torch.distributed as dist
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
