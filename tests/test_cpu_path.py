"""Plain CPU tensors outside the Triton interpreter take the chunked PyTorch path (the backend is
chosen per call): a few training steps of a tiny model with the fused causal-LM loss give the
same losses, metrics, gradients and weights on that path, on the interpreter path, and with
the model's own logits-based loss."""

import copy

import pytest
import torch
from _tiny import assert_grads_close, grads, logits_metrics, tiny_batch, tiny_causal_lm

pytest.importorskip("transformers")


def test_cpu_training_loop_matches_interpreter_and_model_loss(flce, monkeypatch):
    base = tiny_causal_lm("gemma2-softcap")
    batches = [tiny_batch(base, seed=seed) for seed in range(3)]
    runs = {  # name -> (TRITON_INTERPRET, model)
        "own loss": (None, copy.deepcopy(base)),
        "interpreter": ("1", flce.patch_forward(copy.deepcopy(base))),
        "torch": ("0", flce.patch_forward(copy.deepcopy(base))),
    }
    if torch.cuda.is_available():  # the kernels were decorated for the GPU: no interpreter here
        del runs["interpreter"]
    optimizers = {name: torch.optim.SGD(model.parameters(), lr=0.5) for name, (_, model) in runs.items()}

    for batch in batches:
        step = {}
        for name, (interpret, model) in runs.items():
            if interpret is not None:
                monkeypatch.setenv("TRITON_INTERPRET", interpret)
            optimizers[name].zero_grad()
            out = model(**batch) if interpret is None else model(**batch, return_metrics=True)
            out.loss.backward()
            metrics = logits_metrics(out.logits.detach(), batch["labels"]) if interpret is None else out.metrics
            step[name] = (out.loss.detach(), grads(model), metrics)
            optimizers[name].step()

        ref_loss, ref_grads, ref_metrics = step["own loss"]
        for name in [n for n in ("interpreter", "torch") if n in step]:
            loss, _, metrics = step[name]
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
            assert_grads_close(runs[name][1], ref_grads)
            assert int(metrics["num_correct_tokens"]) == ref_metrics["num_correct_tokens"]
            assert int(metrics["num_valid_tokens"]) == ref_metrics["num_valid_tokens"]
            assert float(metrics["entropy_sum"]) == pytest.approx(ref_metrics["entropy_sum"], rel=1e-5)
        # the two fused paths agree more tightly with each other than with the logits
        if "interpreter" in step:
            torch.testing.assert_close(step["torch"][0], step["interpreter"][0], rtol=2e-6, atol=0)

    own = dict(runs["own loss"][1].named_parameters())
    assert any(not torch.equal(p, dict(base.named_parameters())[n]) for n, p in own.items())  # it trained
    for name in [n for n in ("interpreter", "torch") if n in runs]:
        for param_name, p in runs[name][1].named_parameters():
            torch.testing.assert_close(p, own[param_name], rtol=1e-5, atol=1e-6)
