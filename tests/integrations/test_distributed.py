"""Vocabulary-parallel loss over torch.distributed (gloo on the CPU here, NCCL on GPUs through
scripts/gpu_distributed.py): every rank holds a slice of weight's rows, and must get exactly
the loss, metrics and grad_hidden of the unsharded computation, and its slice's gradients."""

import json
import math
import os
import re
import sys
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _ranks import DISAGREEMENTS, UNCHECKED, disagreeing_ranks, disagreement_inputs, exit_without_teardown
from conftest import DEVICE, submodule
from reference import reference

# The interpreter is slow; the sharding logic sits above the backend, so most cases use
# the PyTorch path for CPU tensors (TRITON_INTERPRET=0 at call time) and one the kernels.
CASES = [
    dict(reduction="mean", bias=True, return_metrics=True, label_smoothing=0.1, z_loss_scale=1e-3),
    dict(reduction="sum", softcap=4.0, logit_scale=0.8, return_metrics=True),
    dict(reduction="none", return_lse=True, return_metrics=True),
    # class weights (the whole vocabulary's on every rank), in the forward's gradient sweep and
    # with label smoothing (recomputed); float64 (its own merge of the row max and argmax)
    dict(reduction="mean", class_weight=True, return_metrics=True, z_loss_scale=1e-3),
    dict(reduction="sum", class_weight=True, label_smoothing=0.2, bias=True, return_metrics=True),
    dict(reduction="mean", dtype="float64", bias=True, label_smoothing=0.1, return_metrics=True),
    # the factored gradient (fp32, no bias, softcap or smoothing) of each slice, in the kernels
    dict(reduction="mean", return_metrics=True, kernels=True),
]


def _expected(hidden, weight, bias, targets, case, grad_out, class_weight=None):
    """The float64 reference (``tests/reference.py``) of one case on the full weight, with the
    gradients of sum(loss * grad_out) + 0.3 sum(lse) (the lse term where the case returns it)."""
    options = {k: v for k, v in case.items() if k not in ("return_metrics", "return_lse")}
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in (hidden, weight, bias)]
    lse_grad = torch.full(targets.shape, 0.3) if case.get("return_lse") else None
    return reference(*leaves[:2], targets, leaves[2], class_weight=class_weight, grad_output=grad_out,
                     lse_grad=lse_grad, **options)


def _worker(rank, world, store, error_file):
    try:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are decorated
        # A file store: no TCP port to pick beforehand (which another process could take).
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
        from kernels import get_kernel

        flce = get_kernel("qgallouedec/fused-linear-ce", version=1, trust_remote_code=True)
        for case_index in range(len(CASES)):
            case = dict(CASES[case_index])
            # The backend is chosen per call: two cases through the Triton kernels.
            kernels = case.pop("kernels", False) or case_index == 0
            os.environ["TRITON_INTERPRET"] = "1" if kernels else "0"
            # several chunks of rows (4 x world each): per-chunk all-reduces pair up across ranks
            # (training, case 1), or the chunks' statistics merge once (no gradient sweep, case 2)
            with submodule(flce, "_settings").override(chunk_rows=4 if case_index >= 1 else 4096):
                if kernels and case_index > 0:  # the factored path is what this case is for
                    triton_backend = submodule(flce, "_triton_backend")
                    assert triton_backend.factored_gradient(torch.float32, submodule(flce, "_options").LossOptions(),
                                                            False)
                _check_case(flce, rank, world, case)
        os.environ["TRITON_INTERPRET"] = "0"
        _check_metrics_bit_identity(flce, rank, world)
        _check_data_parallel(flce, rank, world)
        _check_dtensor(flce, rank, world)
        dist.barrier()  # every rank past its last collective before any tears the group down
    except BaseException:
        with open(error_file, "a") as f:
            f.write(f"rank {rank}:\n{traceback.format_exc()}\n")
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    exit_without_teardown()


def _check_metrics_bit_identity(flce, rank, world, device="cpu"):
    """Vocabulary-parallel: return_metrics=True leaves loss and gradients bitwise unchanged."""
    torch.manual_seed(1)
    hidden, weight = torch.randn(19, 16).to(device), torch.randn(41, 16).to(device)
    targets = torch.randint(0, 41, (19,)).to(device)
    sizes = [len(part) for part in torch.arange(41).tensor_split(world)]
    start = sum(sizes[:rank])
    results = []
    for return_metrics in (False, True):
        h = hidden.clone().requires_grad_()
        w = weight[start:start + sizes[rank]].clone().requires_grad_()
        out = flce.fused_linear_cross_entropy(h, w, targets, process_group=dist.group.WORLD,
                                              return_metrics=return_metrics, label_smoothing=0.05)
        loss = out[0] if return_metrics else out
        loss.backward()
        results.append((loss.detach(), h.grad, w.grad))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def _check_data_parallel(flce, rank, world, device="cpu"):
    """Data parallelism: each rank takes its rows; reduction="sum" divided by the global count
    of valid targets, gradients all-reduced, gives the single-process mean loss's gradient, and
    the metrics recipe (all-reduce the sums and counts, then divide) its means."""
    torch.manual_seed(2)
    n = 29
    hidden, weight = torch.randn(n, 16), torch.randn(37, 16) * 0.5
    targets = torch.randint(0, 37, (n,))
    targets[::3] = -100
    hidden, weight, targets = hidden.to(device), weight.to(device), targets.to(device)
    rows = torch.arange(n, device=device).tensor_split(world)[rank]
    num_items = (targets != -100).sum()  # known on every rank (transformers' num_items_in_batch)
    h = hidden[rows].clone().requires_grad_()
    w = weight.clone().requires_grad_()
    loss, metrics = flce.fused_linear_cross_entropy(h, w, targets[rows], reduction="sum", return_metrics=True)
    (loss / num_items).backward()
    grad_w = w.grad.clone()
    dist.all_reduce(grad_w)
    sums = torch.stack([metrics["num_correct_tokens"].double(), metrics["entropy_sum"].double(),
                        (targets[rows] != -100).sum().double()])
    dist.all_reduce(sums)
    whole = weight.clone().requires_grad_()
    hh = hidden.clone().requires_grad_()
    ref_loss, ref_metrics = flce.fused_linear_cross_entropy(hh, whole, targets, return_metrics=True)
    ref_loss.backward()
    # sums of fp32 partial products in another grouping: equal to fp32 rounding (on a GPU the
    # logits are 3xTF32 products, as in _check_on_device)
    tol = dict(rtol=1e-5, atol=1e-7) if device == "cpu" else dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(grad_w, whole.grad, **tol)
    torch.testing.assert_close(h.grad, hh.grad[rows], **tol)
    assert int(sums[0]) == int(ref_metrics["num_correct_tokens"]) and int(sums[2]) == int(num_items)
    torch.testing.assert_close(sums[1] / sums[2], ref_metrics["entropy_sum"].double() / num_items,
                               rtol=tol["rtol"], atol=0)


def _check_dtensor(flce, rank, world, device="cpu"):
    """DTensor inputs: weight and bias placed Shard(0) on a 1-D mesh (torch.chunk's split, uneven
    for 67 rows over 2 or 3 ranks) are vocabulary parallelism, with hidden plain or Replicate;
    weight.grad comes back sharded, outputs follow hidden's kind; other layouts raise."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh(torch.device(device).type, (world,))
    torch.manual_seed(3)  # the same inputs on every rank
    n, hidden_size, vocab = 23, 24, 67
    hidden, weight, bias = torch.randn(n, hidden_size), torch.randn(vocab, hidden_size) * 0.5, torch.randn(vocab)
    targets = torch.randint(0, vocab, (n,))
    targets[::4] = -100
    # fp32 arithmetic against float64 (on a GPU, 3xTF32 products)
    tol = dict(rtol=1e-5, atol=1e-6) if device == "cpu" else dict(rtol=1e-4, atol=1e-5)
    for case in (dict(reduction="mean", return_metrics=True, label_smoothing=0.1),
                 dict(reduction="none", return_lse=True, return_metrics=True)):
        replicated_hidden = case["reduction"] == "none"
        w = distribute_tensor(weight.to(device), mesh, [Shard(0)]).requires_grad_()
        b = distribute_tensor(bias.to(device), mesh, [Shard(0)]).requires_grad_()
        h = hidden.to(device)
        h = (distribute_tensor(h, mesh, [Replicate()]) if replicated_hidden else h.clone()).requires_grad_()
        out = flce.fused_linear_cross_entropy(h, w, targets.to(device), b, **case)
        loss, metrics, lse = out if case.get("return_lse") else (*out, None)
        assert isinstance(loss, DTensor) == replicated_hidden
        if replicated_hidden:
            assert loss.placements == (Replicate(),) and lse.placements == (Replicate(),)
            loss, lse, metrics = loss.to_local(), lse.to_local(), {k: v.to_local() for k, v in metrics.items()}
        grad_out = torch.linspace(0.5, 1.5, n) if replicated_hidden else torch.tensor(0.7)
        total = (loss * grad_out.to(device)).sum() + (lse.sum() * 0.3 if lse is not None else 0)
        total.backward()
        assert isinstance(w.grad, DTensor) and w.grad.placements == (Shard(0),)
        assert isinstance(b.grad, DTensor) and b.grad.placements == (Shard(0),)
        if replicated_hidden:
            assert h.grad.placements == (Replicate(),)

        ref = _expected(hidden, weight, bias, targets, case, grad_out)
        torch.testing.assert_close(loss.double().cpu(), ref.loss, **tol)
        assert int(metrics["num_correct_tokens"]) == ref.num_correct
        torch.testing.assert_close(metrics["entropy_sum"].double().cpu(), ref.entropy_sum, **tol)
        if lse is not None:
            torch.testing.assert_close(lse.double().cpu(), ref.lse, **tol)
        grad_hidden = h.grad.full_tensor() if replicated_hidden else h.grad
        torch.testing.assert_close(grad_hidden.double().cpu(), ref.grad_hidden, **tol)
        torch.testing.assert_close(w.grad.full_tensor().double().cpu(), ref.grad_weight, **tol)
        torch.testing.assert_close(b.grad.full_tensor().double().cpu(), ref.grad_bias, **tol)

    w = distribute_tensor(weight.to(device), mesh, [Shard(0)])
    h, t = hidden.to(device), targets.to(device)
    bad = [
        (dict(weight=distribute_tensor(weight.to(device), mesh, [Replicate()])), ValueError, r"placed \(Replicate"),
        (dict(weight=distribute_tensor(weight.to(device), mesh, [Shard(1)])), ValueError, r"\(Shard\(0\),\)"),
        (dict(hidden=distribute_tensor(h, mesh, [Shard(0)])), ValueError, "hidden is a DTensor placed"),
        (dict(bias=bias.to(device)), TypeError, "bias must be a DTensor"),
        (dict(weight=weight.to(device), hidden=distribute_tensor(h, mesh, [Replicate()])), TypeError,
         "weight must be a DTensor"),
        (dict(process_group=dist.group.WORLD), ValueError, "pass neither"),
        # each rank its own targets (data parallelism): a wrong loss without the check
        (dict(targets=(t + rank) % vocab), ValueError, "ranks disagree on targets"),
    ]
    for change, error, message in bad:
        inputs = {"hidden": h, "weight": w, "targets": t, **change}
        with pytest.raises(error, match=message):
            flce.fused_linear_cross_entropy(**inputs)


def _check_case(flce, rank, world, case, device="cpu"):
    """One case on this rank, with the inputs on ``device`` (gloo on the CPU; NCCL on a GPU, from
    scripts/gpu_distributed.py), against the float64 reference on the full weight."""
    torch.manual_seed(0)  # the same inputs on every rank
    n, hidden_size, vocab = 23, 24, 67  # 67 does not split evenly over 2 or 3 ranks
    dtype = getattr(torch, case.pop("dtype", "float32"))  # a name: scripts/gpu_distributed.py writes cases to JSON
    hidden = torch.randn(n, hidden_size, dtype=dtype)
    weight = torch.randn(vocab, hidden_size, dtype=dtype) * 0.5
    bias = torch.randn(vocab, dtype=dtype) if case.pop("bias", False) else None
    targets = torch.randint(0, vocab, (n,))
    targets[::4] = -100
    class_weight = torch.rand(vocab) + 0.5 if case.pop("class_weight", False) else None
    # ties across the shard boundary: two rows of weight equal, in different slices
    weight[vocab // world + 1] = weight[1]

    sizes = [len(part) for part in torch.arange(vocab).tensor_split(world)]
    start = sum(sizes[:rank])
    local = slice(start, start + sizes[rank])
    w_local = weight[local].clone().to(device).requires_grad_()
    b_local = bias[local].clone().to(device).requires_grad_() if bias is not None else None
    h = hidden.clone().to(device).requires_grad_()
    out = flce.fused_linear_cross_entropy(h, w_local, targets.to(device), b_local, process_group=dist.group.WORLD,
                                          class_weight=None if class_weight is None else class_weight.to(device),
                                          **case)
    loss, metrics, lse = out if case.get("return_lse") else (*out, None)
    grad_out = torch.linspace(0.5, 1.5, n) if case["reduction"] == "none" else torch.tensor(0.7)
    total = (loss * grad_out.to(device)).sum() + (lse.sum() * 0.3 if lse is not None else 0)
    total.backward()

    ref = _expected(hidden, weight, bias, targets, case, grad_out, class_weight)
    # fp32 arithmetic against float64: a few ulps of the sums involved; on a GPU, fp32 follows
    # torch's float32 matmul precision (3xTF32 products)
    tol = dict(rtol=1e-5, atol=1e-6) if device == "cpu" else dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(loss.double().cpu(), ref.loss, **tol)
    assert int(metrics["num_correct_tokens"]) == ref.num_correct
    assert torch.equal(metrics["predictions"].cpu(), ref.predictions)  # global indices, ties across slices
    torch.testing.assert_close(metrics["entropy_sum"].double().cpu(), ref.entropy_sum, **tol)
    if lse is not None:
        torch.testing.assert_close(lse.double().cpu(), ref.lse, **tol)
    torch.testing.assert_close(h.grad.double().cpu(), ref.grad_hidden, **tol)
    torch.testing.assert_close(w_local.grad.double().cpu(), ref.grad_weight[local], **tol)
    if bias is not None:
        torch.testing.assert_close(b_local.grad.double().cpu(), ref.grad_bias[local], **tol)
    # every rank holds bitwise the same loss and metrics
    gathered = [torch.zeros(3, dtype=torch.float64, device=device) for _ in range(world)]
    mine = torch.stack([loss.detach().double().sum(), metrics["num_correct_tokens"].double(),
                        metrics["entropy_sum"].double()])
    dist.all_gather(gathered, mine)
    assert all(torch.equal(g, gathered[0]) for g in gathered)


@pytest.mark.skipif(DEVICE != "cpu", reason="gloo on CPU tensors; GPUs run scripts/gpu_distributed.py")
@pytest.mark.parametrize("world", [2, 3])
def test_vocab_parallel_matches_unsharded(world, tmp_path):
    error_file = tmp_path / "errors.txt"
    mp.spawn(_worker, args=(world, str(tmp_path / "store"), str(error_file)), nprocs=world, join=True)
    assert not error_file.exists(), error_file.read_text()


# What every rank must raise when the ranks' arguments differ as in _ranks.DISAGREEMENTS: the
# same ValueError, raised after one all-reduce, before any other collective (no NaN, no hang, no abort).
RAISES = {
    "targets shifted by one position": r"ranks disagree on targets: rank 0 has fingerprint .*, rank 1 has",
    "one target": "ranks disagree on targets",
    "return_lse": "ranks disagree on return_lse: rank 0 has False, rank 1 has True",
    "an overlapping vocab_start": (r"vocabulary slices overlap or leave a gap: rank 0 holds \[0, 20\), "
                                   r"rank 1 holds \[15, 35\); they must tile \[0, 40\)"),
    "an out-of-range vocab_start": r"rank 0 holds \[0, 20\), rank 1 holds \[40, 60\)",
    "ignore_index": "ranks disagree on ignore_index: rank 0 has -100, rank 1 has -1",
    "a bad target on one rank": "ranks disagree on targets",
    "a bad target on every rank": r"targets must be in \[0, 40\) or ignore_index=-100, found -5",
    "N": "ranks disagree on the number of rows N: rank 0 has 32, rank 1 has 30",
    "the hidden dtype": "ranks disagree on hidden's dtype: rank 0 has torch.float32, rank 1 has torch.float64",
    "requires_grad": ("ranks disagree on gradients: rank 0 has grad enabled with gradients for hidden, weight, "
                      "rank 1 has grad enabled with gradients for weight"),
    "H": "ranks disagree on the hidden size H: rank 0 has 16, rank 1 has 15",
    "logit_scale by one ulp": "ranks disagree on logit_scale: rank 0 has 1.0, rank 1 has 1.0000000000000002",
    "softcap": "ranks disagree on softcap: rank 0 has None, rank 1 has 30.0",
    "reduction": "ranks disagree on reduction: rank 0 has 'mean', rank 1 has 'sum'",
    "return_metrics": "ranks disagree on return_metrics",
    "label_smoothing": "ranks disagree on label_smoothing: rank 0 has 0.0, rank 1 has 0.1",
    "z_loss_scale": "ranks disagree on z_loss_scale",
    "shift": "ranks disagree on shift: rank 0 has 0, rank 1 has 1",
    "class_weight present": "ranks disagree on class_weight: rank 0 has None, rank 1 has a float tensor of 40 values",
    "class_weight's values": "ranks disagree on class_weight's values",
    "class_weight's requires_grad": ("ranks disagree on class_weight: rank 0 has a float tensor of 40 values, "
                                     "rank 1 has a float tensor of 40 values that requires grad"),
    "bias": "ranks disagree on bias: rank 0 has no bias, rank 1 has a bias",
}


@pytest.fixture(scope="module")
def disagreement_outcomes(flce, tmp_path_factory):
    """Each rank's outcome of every case of _ranks.DISAGREEMENTS: two spawned gloo ranks, given at
    most 300 s in all on a loaded machine (a hang would take the collectives' 20 s timeout per case).
    Spawned, not forked: a rank forked from a pytest process whose earlier tests started thread
    pools (OpenMP, torch.compile's workers) can hang in its first parallel region."""
    path = tmp_path_factory.mktemp("disagreements")
    results = str(path / "outcomes")
    ranks = mp.start_processes(disagreeing_ranks, args=(str(path / "store"), results), nprocs=2, join=False,
                               start_method="spawn")
    deadline, failure = time.monotonic() + 300, None
    try:
        while not ranks.join(timeout=1):
            if time.monotonic() > deadline:
                failure = "the ranks did not finish within 300 s"
                break
    except Exception as error:  # a rank that died (e.g. gloo's abort): its outcomes so far are kept
        failure = f"{type(error).__name__}: {error}"
    finally:
        for process in ranks.processes:
            if process.is_alive():
                process.kill()
    outcomes = []
    for rank in range(2):
        saved = path / f"outcomes.{rank}"
        outcomes.append(json.loads(saved.read_text()) if saved.exists() else {})
    return outcomes, failure


@pytest.mark.skipif(DEVICE != "cpu", reason="gloo on CPU tensors")
@pytest.mark.parametrize("case", list(RAISES))
def test_ranks_that_disagree_all_raise_the_same_error(disagreement_outcomes, case):
    outcomes, failure = disagreement_outcomes
    assert all(case in o for o in outcomes), f"case {case!r} not reached on every rank: {failure}"
    first, second = outcomes[0][case], outcomes[1][case]
    assert first[:2] == ["raised", "ValueError"], first
    assert first == second  # the same error, on every rank
    assert re.search(RAISES[case], first[2]), first[2]


@pytest.mark.skipif(DEVICE != "cpu", reason="gloo on CPU tensors")
@pytest.mark.parametrize("case", ["agreeing ranks", "agreeing slices in the other order", UNCHECKED])
def test_ranks_that_agree_after_errors_get_the_whole_vocabularys_loss(disagreement_outcomes, case):
    """After the errors the group is still in step: every rank gets the mean loss of the whole
    vocabulary, as float64 F.cross_entropy (fp32 logits: a few ulps of rounding)."""
    assert set(DISAGREEMENTS) == set(RAISES) | {"agreeing ranks", "agreeing slices in the other order"}
    outcomes, failure = disagreement_outcomes
    assert all(case in o for o in outcomes), f"case {case!r} not reached on every rank: {failure}"
    hidden, weight, targets = disagreement_inputs()
    expected = torch.nn.functional.cross_entropy(hidden.double().flatten(0, 1) @ weight.double().T, targets.flatten())
    for outcome in outcomes:
        assert outcome[case][0] == "returned" and not math.isnan(outcome[case][1]), outcome[case]
        assert outcome[case][1] == pytest.approx(expected.item(), rel=1e-6)


if __name__ == "__main__":  # python tests/test_distributed.py: one case, for debugging
    sys.exit(pytest.main([__file__, "-x", "-q"]))
