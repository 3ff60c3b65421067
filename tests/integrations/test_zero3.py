"""DeepSpeed ZeRO-3: a patched model inside ``deepspeed.initialize`` (one process) trains as the
unpatched one does. ZeRO-3 partitions every parameter (the lm_head weight has numel 0 outside
its module's forward); the fused loss runs as lm_head's forward, so DeepSpeed's module hooks
gather the weight for it and for its backward.

On the CPU, DeepSpeed's CPU accelerator and gloo; on a GPU (the same file, marked gpu), NCCL.
"""

import sys

import pytest
import torch
from _tiny import logits_metrics, tiny_batch, tiny_causal_lm
from conftest import HAS_CUDA

pytest.importorskip("transformers")
deepspeed = pytest.importorskip("deepspeed")

STEPS = 2
LEARNING_RATE = 0.1


@pytest.fixture
def one_process_group(tmp_path, monkeypatch):
    """A default process group of one rank (a file store: no port to share with xdist's workers),
    destroyed afterwards, so that no later test finds it."""
    from deepspeed.accelerator import get_accelerator

    # DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce op with g++ at init (minutes
    # on two cores); one process has nothing to all-reduce with.
    monkeypatch.setattr(sys.modules["deepspeed.comm.torch"], "build_shm_op", lambda: None)
    for name in ("RANK", "LOCAL_RANK"):
        monkeypatch.setenv(name, "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    backend = get_accelerator().communication_backend_name()
    deepspeed.init_distributed(backend, auto_mpi_discovery=False, init_method=f"file://{tmp_path / 'store'}",
                               rank=0, world_size=1)
    yield
    torch.distributed.destroy_process_group()


def _train_zero3(model, batches, **call_kwargs) -> tuple[list, list[dict], dict]:
    """``STEPS`` SGD steps of ``model`` under ZeRO-3: each step's output and full gradients (read
    before the step), and the final parameters, gathered."""
    config = {
        "train_micro_batch_size_per_gpu": batches[0]["input_ids"].shape[0],
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},  # partition every tensor
        "zero_allow_untested_optimizer": True,
    }
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    assert model.lm_head.weight.numel() == 0  # partitioned: the loss cannot read it as is
    outputs, step_grads = [], []
    for batch in batches:
        out = engine(**batch, **call_kwargs)
        engine.backward(out.loss)
        step_grads.append({name: deepspeed.utils.safe_get_full_grad(p).clone() for name, p in model.named_parameters()})
        engine.step()
        outputs.append(out)
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        params = {name: p.detach().clone() for name, p in model.named_parameters()}
    return outputs, step_grads, params


@pytest.mark.parametrize("device", [
    pytest.param("cpu", marks=pytest.mark.skipif(HAS_CUDA, reason="DeepSpeed takes the CUDA accelerator here")),
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")]),
])
def test_patched_model_under_zero3_trains_as_the_unpatched(flce, monkeypatch, one_process_group, device):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # CPU tensors: the PyTorch path, as in training
    reference = tiny_causal_lm("llama")
    batches = [{k: v.to(device) for k, v in tiny_batch(reference, seed=seed).items()} for seed in range(STEPS)]
    reference = reference.to(device)
    patched = flce.patch_forward(tiny_causal_lm("llama").to(device))  # the same seed: the same weights

    ref_out, ref_grads, ref_params = _train_zero3(reference, batches)
    out, grads, params = _train_zero3(patched, batches, return_metrics=True)

    # fp32 on both sides; the fused loss adds the row losses in another order (CPU), and on a GPU
    # the kernel's 3xTF32 products against cuBLAS's fp32
    rel = 1e-5 if device == "cpu" else 1e-4
    for step in range(STEPS):
        assert out[step].logits is None  # the fused path ran
        torch.testing.assert_close(out[step].loss.detach(), ref_out[step].loss.detach(), rtol=rel, atol=0)
        expected = logits_metrics(ref_out[step].logits.detach(), batches[step]["labels"])
        assert int(out[step].metrics["num_valid_tokens"]) == expected["num_valid_tokens"]
        assert int(out[step].metrics["num_correct_tokens"]) == expected["num_correct_tokens"]
        for name, grad in grads[step].items():  # every parameter, the lm_head's included
            want = ref_grads[step][name]
            torch.testing.assert_close(grad, want, rtol=rel, atol=rel * want.abs().max())
    assert set(params) == set(ref_params)
    # SGD at lr 0.1 from gradients equal within fp32 rounding: the parameters agree as closely
    for name, p in params.items():
        torch.testing.assert_close(p, ref_params[name], rtol=rel, atol=rel * ref_params[name].abs().max())
