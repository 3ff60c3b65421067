"""The device launches of one training step, counted on the CPU (Triton interpreter).

    TRITON_INTERPRET=1 python lab/launch_count.py --json launches.json [--rows 1024 --vocab 4096]
        [--forward]

A step of a large head is bound by its products, but each small launch around them (an
elementwise op, a sort's passes) still costs the GPU 2-4 us, and the host more. This counts,
for one forward and backward of ``fused_linear_cross_entropy`` (fp32, the factored gradient,
random targets with 10% ignored; with ``--forward``, an evaluation forward), the Triton kernels
launched and the ATen ops that do work on tensors (each at least one kernel on a GPU, a sort
several; views and allocations excluded), by name, so that a change's launches can be compared
without a GPU.
"""

import argparse
import json
import os
import sys
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
# ATen ops that launch nothing on a GPU themselves: views, metadata, allocations, and wrappers
# whose work shows as the ops inside them.
NO_LAUNCH = ("view", "_unsafe_view", "alias", "as_strided", "t", "transpose", "permute", "expand", "slice",
             "select", "unsqueeze", "squeeze", "detach", "empty", "empty_like", "empty_strided", "new_empty",
             "new_empty_strided", "lift_fresh", "_local_scalar_dense", "is_nonzero", "sym_size", "sym_stride",
             "sym_numel", "sym_storage_offset", "split", "unbind", "reshape", "_reshape_alias", "diagonal",
             "to", "_to_copy", "contiguous", "clone", "flatten", "resize_", "zeros", "zeros_like", "ones_like",
             "full", "new_zeros", "new_full", "resolve_conj", "resolve_neg", "_local_scalar_dense")


def _does_work(event) -> bool:
    """An ATen op that is not a view, allocation or no-op wrapper, or that has one inside it."""
    name = event.name[len("aten::"):]
    return event.name.startswith("aten::") and (
        name not in NO_LAUNCH or any(_does_work(child) for child in event.cpu_children))


def _launching(event) -> bool:
    """Whether a profiler event is an ATen op the step itself calls (inside no other ATen op,
    nor a Triton launch: the interpreter's copies of its arguments) that does work on a device:
    at least one kernel on a GPU (a ``to`` that converts, a ``zeros``; not a view or a ``to``
    that has nothing to do)."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith(("aten::", "triton::")):
            return False
        parent = parent.cpu_parent
    return _does_work(event)


def count_step(flce, n_rows: int, vocab_size: int, hidden_size: int, seed: int = 0, forward: bool = False) -> dict:
    """{"triton": {kernel: launches}, "aten": {op: calls}, "total"} of one training step (with
    ``forward``, of an evaluation forward: no gradients)."""
    from triton.runtime.interpreter import InterpretedFunction

    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n_rows, hidden_size, generator=gen).requires_grad_(not forward)
    weight = (torch.randn(vocab_size, hidden_size, generator=gen) / hidden_size ** 0.5).requires_grad_(not forward)
    targets = torch.randint(0, vocab_size, (n_rows,), generator=gen)
    targets[torch.rand(n_rows, generator=gen) < 0.1] = -100

    def step():
        loss = flce.fused_linear_cross_entropy(hidden, weight, targets)
        if not forward:
            loss.backward()

    step()  # warm-up (compiles, plans)
    hidden.grad = weight.grad = None

    run = InterpretedFunction.run

    def recorded_run(self, *args, **kwargs):
        with torch.profiler.record_function(f"triton::{self.fn.__name__}"):
            return run(self, *args, **kwargs)

    InterpretedFunction.run = recorded_run
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            step()
    finally:
        InterpretedFunction.run = run
    events = prof.events()
    triton_launches = Counter(e.name[len("triton::"):] for e in events if e.name.startswith("triton::"))
    aten = Counter(e.name[len("aten::"):] for e in events if _launching(e))
    return {"triton": dict(sorted(triton_launches.items())), "aten": dict(sorted(aten.items())),
            "total": sum(triton_launches.values()) + sum(aten.values())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--forward", action="store_true", help="an evaluation forward (no gradients)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("launch_count.py runs the kernels in the Triton interpreter: set TRITON_INTERPRET=1")
    sys.path.insert(0, str(ROOT / "torch-ext"))
    import fused_linear_ce

    counts = count_step(fused_linear_ce, args.rows, args.vocab, args.hidden, forward=args.forward)
    record = {"command": " ".join(sys.argv), "rows": args.rows, "vocab": args.vocab, "hidden": args.hidden,
              "step": "forward" if args.forward else "training",
              "torch": torch.__version__, "git": os.popen(f"git -C {ROOT} rev-parse --short HEAD").read().strip(),
              "dirty": bool(os.popen(f"git -C {ROOT} status --porcelain -- torch-ext").read().strip()),
              **counts}
    print(json.dumps(record, indent=1))
    if args.json:
        args.json.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
