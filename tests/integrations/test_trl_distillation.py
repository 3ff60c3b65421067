"""TRL 1.16's DistillationTrainer trains the same with ``flce.trl.use_in_trl()`` as with TRL's own
divergence kernel (``ChunkedDivergenceFunction``), which ours replaces and nothing else.

A tiny Llama student (hidden 32) distils from a tiny Llama teacher of another width (hidden 48)
a few SGD steps, twice from the same checkpoint, data and seed: the logged loss, grad_norm and
entropy and every parameter after the steps must agree. The student stops its completions at
any of a third of the vocabulary, so that TRL masks the positions after the stop. On CPU tensors
TRL passes every position and zeroes the masked ones' divergence afterwards (our backward then
recomputes, for the rows with an upstream gradient); on CUDA it passes the valid rows only (our
gradient is made in the forward): both are run, the second by making TRL take CPU tensors for
Triton's.

Tolerance, float32 on the CPU: rel 1e-5, as tests/integrations/test_trl.py's: both kernels
compute in float32 from the same hidden states and weights and differ in the order of their
sums over the vocabulary, a few ulps amplified through two layers' backward and a few steps. The
trainers run the PyTorch path (TRITON_INTERPRET=0); the kernel path is checked against TRL's
kernel directly, on tensors (``test_kernel_matches_trls``).
"""

import pytest
import torch
from _tiny import CLOCK_SUFFIXES, VOCAB, TrlRun, assert_runs_match, save_tiny_checkpoint, trl_dataset
from conftest import tolerance

trl = pytest.importorskip("trl")
from trl.trainer import distillation_trainer  # noqa: E402

REL = 1e-5  # float32 rounding, see the module docstring
STOP_TOKENS = [2, *range(3, VOCAB // 3)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(student checkpoint path, teacher model): the student as TRL loads it, stopping its
    completions at STOP_TOKENS; a wider teacher of the same vocabulary."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    path = save_tiny_checkpoint(tmp_path_factory.mktemp("student"))
    GenerationConfig(eos_token_id=STOP_TOKENS, pad_token_id=0, bos_token_id=1).save_pretrained(path)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=1,
                         eos_token_id=2, initializer_range=0.2)
    torch.manual_seed(1)
    return path, LlamaForCausalLM(config).eval()


def train(student_path, teacher, output_dir, beta: float, steps: int, use_in_trl=None) -> TrlRun:
    """``steps`` SGD steps of DistillationTrainer (TRL's kernel, or with ``use_in_trl`` ours);
    the log records (without clock values) and the parameters after them."""
    args = trl.DistillationConfig(
        output_dir=str(output_dir), max_steps=steps, per_device_train_batch_size=4, optim="sgd", learning_rate=0.5,
        logging_steps=1, report_to="none", save_strategy="no", use_cpu=True, bf16=False, seed=0, disable_tqdm=True,
        max_completion_length=6, temperature=0.9, beta=beta, gradient_checkpointing=False)  # (TRL's default: slow)
    if use_in_trl is not None:
        use_in_trl()
    try:
        trainer = trl.DistillationTrainer(model=student_path, teacher_model=teacher, args=args,
                                          train_dataset=trl_dataset("grpo", 16))
        kernel = distillation_trainer.ChunkedDivergenceFunction
        trainer.train()
    finally:
        if use_in_trl is not None:
            use_in_trl(False)
    logs = [{k: v for k, v in r.items() if not k.endswith(CLOCK_SUFFIXES)} for r in trainer.state.log_history]
    params = {name: p.detach().cpu().clone() for name, p in trainer.model.named_parameters()}
    return TrlRun(logs, params, [], kernel, [])


def test_mixed_dtypes_as_trls_kernel_takes_them(flce, path):
    """16-bit hidden states beside an fp32 weight (the student's) and the reverse (the teacher's):
    the stand-in casts each weight to its hidden states' dtype and the weight's gradient comes
    back in its own dtype, as with TRL's kernel."""
    gen = torch.Generator().manual_seed(11)
    hidden = torch.randn(5, 16, generator=gen, dtype=torch.float16).to(path.device).requires_grad_()
    weight = (torch.randn(40, 16, generator=gen) * 0.5).to(path.device).requires_grad_()
    teacher = [torch.randn(5, 8, generator=gen).to(path.device),
               torch.randn(40, 8, generator=gen, dtype=torch.float16).to(path.device)]
    divergence, _ = flce.distillation.TrlDivergence.apply(hidden, weight, None, *teacher, None, 0.5)
    divergence.sum().backward()
    assert hidden.grad.dtype == torch.float16 and weight.grad.dtype == torch.float32
    expected, _ = flce.fused_linear_divergence(hidden.detach(), weight.detach().half(), teacher[0],
                                               teacher[1].float(), beta=0.5)
    assert torch.equal(divergence, expected)


def test_use_in_trl_swaps_the_divergence_and_back(flce):
    trls = distillation_trainer.ChunkedDivergenceFunction
    try:
        flce.trl.use_in_trl()
        flce.trl.use_in_trl()
        ours = distillation_trainer.ChunkedDivergenceFunction
        assert ours is not trls and ours.__module__ == f"{flce.__name__}.distillation"
    finally:
        flce.trl.use_in_trl(False)
    assert distillation_trainer.ChunkedDivergenceFunction is trls


@pytest.mark.parametrize("beta, options", [
    (0.0, (1.0, 1.0, None, 1.0, None)),
    (0.5, (0.7, 1.3, 3.0, 0.8, None)),
    (1.0, (1.2, 1.0, None, 1.0, 2.0)),
])
def test_kernel_matches_trls(flce, path, beta, options):
    """The stand-in returns what TRL's kernel returns, on its arguments (float32, with biases)."""
    gen = torch.Generator().manual_seed(int(10 * beta))
    n_rows, vocab, student_h, teacher_h = 6, 50, 16, 24
    student = [torch.randn(n_rows, student_h, generator=gen), torch.randn(vocab, student_h, generator=gen) * 0.7,
               torch.randn(vocab, generator=gen)]
    teacher = [torch.randn(n_rows, teacher_h, generator=gen), torch.randn(vocab, teacher_h, generator=gen) * 0.6,
               torch.randn(vocab, generator=gen)]
    upstream = torch.rand(n_rows, generator=gen)
    results = []  # TRL's kernel on the CPU (PyTorch ops in fp32), ours on the path's device
    for kernel, device in ((distillation_trainer.ChunkedDivergenceFunction, "cpu"),
                           (flce.distillation.TrlDivergence, path.device)):
        leaves = [t.clone().to(device).requires_grad_() for t in student]
        divergence, entropy = kernel.apply(*leaves, *(t.to(device) for t in teacher), beta, *options)
        (divergence * upstream.to(device)).sum().backward()
        results.append([divergence, entropy, *(t.grad for t in leaves)])
    tol = tolerance(torch.float32, "grad")  # two fp32 computations, sums in other orders
    for name, theirs, ours in zip(("divergence", "entropy", "hidden", "weight", "bias"), *results, strict=True):
        scale = theirs.abs().max().item()
        err = (ours.double().cpu() - theirs.double().cpu()).abs().max().item()
        assert err <= tol * max(scale, 1.0), f"{name}: {err:.3g} against TRL's kernel (scale {scale:.3g})"


@pytest.mark.parametrize("beta, valid_rows_only, steps", [(0.5, False, 3), (1.0, True, 3)],
                         ids=["jsd-masked-rows", "reverse-kl-valid-rows"])
def test_trainer_trains_as_with_trls_kernel(flce, models, tmp_path, monkeypatch, beta, valid_rows_only, steps):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the PyTorch path for CPU tensors
    if valid_rows_only:
        monkeypatch.setattr(distillation_trainer, "_use_triton", lambda device: True)
    reference = train(*models, tmp_path / "trl", beta, steps)
    fused = train(*models, tmp_path / "flce", beta, steps, use_in_trl=flce.trl.use_in_trl)
    assert reference.head.__module__.startswith("trl.") and fused.head is flce.distillation.TrlDivergence
    assert {"loss", "grad_norm", "entropy"} <= set(reference.logs[0])
    # the completions stop early on some rows: TRL masks their tails
    lengths = [r["completions/mean_length"] for r in reference.logs if "completions/mean_length" in r]
    assert min(lengths) < 6
    assert_runs_match(reference, fused, REL)
    losses = [r["loss"] for r in reference.logs if "loss" in r]
    assert len(set(losses)) > 1 and min(losses) > 0
