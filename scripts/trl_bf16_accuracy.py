"""bf16 accuracy of TRL's fused-head kernel and of ``flce.trl.FusedLogProbs`` against float64.

Both get the same bf16 hidden states and weight; the reference is float64 from those rounded
inputs. Prints the largest error of a log-prob and of an entropy, for logits of O(1) and O(4)
(the numbers of docs/integrations.md, measured on a CPU; on a GPU the Triton kernels run).

    python scripts/trl_bf16_accuracy.py [--device cuda]
"""

import argparse
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shape", type=int, nargs=3, default=(512, 256, 4096), metavar=("N", "H", "V"))
    args = parser.parse_args()
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "0"  # CPU tensors take the kernel's PyTorch path
    import torch
    from kernels import get_local_kernel
    from trl.kernels import ChunkedLogProbFunction

    flce = get_local_kernel(ROOT / "build" / ("torch-cuda" if args.device == "cuda" else "torch-cpu"))
    n, h, v = args.shape
    torch.manual_seed(0)
    for scale in (1.0, 4.0):
        hidden = torch.randn(n, h, device=args.device).bfloat16()
        weight = (torch.randn(v, h, device=args.device) * scale / h**0.5).bfloat16()
        targets = torch.randint(0, v, (n,), device=args.device)
        log_p = torch.log_softmax(hidden.double() @ weight.double().T, dim=-1)
        expected = log_p.gather(1, targets[:, None])[:, 0], -(log_p.exp() * log_p).sum(-1)
        for name, kernel in (("TRL", ChunkedLogProbFunction), ("fused-linear-ce", flce.trl.FusedLogProbs)):
            out = kernel.apply(hidden, weight, None, targets, 1.0, 128, None, 1.0, ("entropy",))
            errors = [(got.double() - want).abs().max().item() for got, want in zip(out[:2], expected, strict=True)]
            print(f"{args.device} logits O({scale:g}) {name:>16}: log_probs {errors[0]:.1e}  entropy {errors[1]:.1e}")


if __name__ == "__main__":
    main()
