"""Where grad_weight's error comes from, in float64 on a CPU: each 16-bit rounding of the
factored training step, switched on one at a time, on uniform logits (z ~ N(0, 1), targets
uniform, as bench.py's "uniform" inputs).

The factored step computes grad_weight = sum over chunks of E'^T (diag(r) H), with E' the
16-bit exponentials exp(z - z_t) (1 - exp(lse - z_t) at the target) and r = g exp(z_t - lse).
Its roundings, beside the 16-bit inputs and output that PyTorch shares:

- ``target``: "rounded", E' at the target rounded to 16 bits, without r taking that rounding
  (the code before r did); "exact", r takes it, so that r E'_it is exact (the code for frequent
  targets);
- ``scaled rows``: diag(r) H rounded to 16 bits for the product;
- ``chunk sums``: the 16-bit grad_weight rounded after each chunk's product is added, "once"
  (the sum of the product and the running sum rounded), or "twice" (the product rounded to 16
  bits first, as cuBLAS's accumulating bf16 product does on the H200: perf notes, run 57);
- ``out``: the rule of the code since run 53 instead of ``target``: the target entry taken out
  of the products (0 in E'), its c h_i = g (p_t - 1) h_i summed in fp32 and added to grad_weight
  at its last rounding. On these inputs every row qualifies (p_t < 2^-10); the rows of frequent,
  well predicted targets, which keep their entry in the products, are not modelled here.

PyTorch's bf16 step rounds the logits to 16 bits, takes the softmax in fp32 and rounds its
gradient to 16 bits. Errors are relative Frobenius norms against the float64 gradient.

    python lab/rounding_model.py [--rows 4096] [--vocab 65536] [--hidden 256] [--chunks 5]
"""

import argparse
import itertools

import torch


def bf16(x: torch.Tensor) -> torch.Tensor:
    """x rounded to bfloat16 (to nearest even), back in float64."""
    return x.to(torch.bfloat16).to(torch.float64)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=65536)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--chunks", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(args.seed)
    n, v, h_size = args.rows, args.vocab, args.hidden
    hidden = bf16(torch.randn(n, h_size, generator=gen, dtype=torch.float64))
    weight = bf16(torch.randn(v, h_size, generator=gen, dtype=torch.float64) / h_size**0.5)
    targets = torch.randint(0, v, (n,), generator=gen)
    # A mean over the rows with a loss (bench.py ignores 10%): 1 / count, not a power of two, so
    # that PyTorch's 16-bit gradient rounds g (p_t - 1) as it does in training.
    loss_grad = 1.0 / (n - n // 10)
    onehot = torch.nn.functional.one_hot(targets, v).to(torch.float64)

    logits = hidden @ weight.T
    exact = (loss_grad * (torch.softmax(logits, 1) - onehot)).T @ hidden

    def rel_err(grad_weight):
        return float((grad_weight - exact).norm() / exact.norm())

    probs_bf16 = torch.softmax(bf16(logits).float(), 1).double()
    pytorch = rel_err(bf16(bf16(loss_grad * (probs_bf16 - onehot)).T @ hidden))
    print(f"PyTorch bf16: {pytorch:.3e}")

    target_logit = logits.gather(1, targets[:, None])
    lse = torch.logsumexp(logits, 1, keepdim=True)
    exps = bf16(torch.exp(logits - target_logit))
    at_target = exps.gather(1, targets[:, None]) - torch.exp(lse - target_logit)
    stored = bf16(at_target)
    exps.scatter_(1, targets[:, None], stored)
    row_factor = loss_grad * torch.exp(target_logit - lse)
    chunk = -(-n // args.chunks)

    exps_out = exps.scatter(1, targets[:, None], 0.0)
    target_grad = (loss_grad * (torch.exp(target_logit - lse) - 1.0)).float().double()  # c, in fp32
    target_terms = torch.zeros(v, h_size, dtype=torch.float64).index_add_(0, targets, target_grad * hidden)

    print("target  scaled rows  chunk sums   error    / PyTorch's")
    for target, scaled_rows, chunk_sums in itertools.product(("rounded", "exact", "out"), (True, False),
                                                             ("twice", "once", "none")):
        factor = row_factor * at_target / stored if target == "exact" else row_factor
        entries = exps_out if target == "out" else exps
        grad_weight = torch.zeros(v, h_size, dtype=torch.float64)
        for start in range(0, n, chunk):
            rows = slice(start, start + chunk)
            scaled = factor[rows] * hidden[rows]
            part = entries[rows].T @ (bf16(scaled) if scaled_rows else scaled)
            if chunk_sums == "twice":
                part = bf16(part)
            grad_weight = grad_weight + part if chunk_sums == "none" else bf16(grad_weight + part)
        if target == "out":
            grad_weight = grad_weight + target_terms
        err = rel_err(bf16(grad_weight))
        print(f"{target:7} {scaled_rows!s:12} {chunk_sums:10} {err:.3e}  {err / pytorch:.2f}")


if __name__ == "__main__":
    main()
