"""Errors that name what was passed: meta tensors, ``outputs=None``; and the package's public names."""

import pytest
import torch


@pytest.mark.parametrize("meta", ["hidden", "weight", "all"])
@pytest.mark.parametrize("function", ["fused_linear_cross_entropy", "fused_linear_log_probs"])
def test_meta_tensors_are_refused_by_name(flce, function, meta):
    """A model built under torch.device("meta") and not loaded: the shared checks say which input is
    a meta tensor (not an internal error of autocast's dispatch)."""
    hidden, weight = torch.randn(4, 8), torch.randn(16, 8)
    targets = torch.tensor([1, 2, 3, 4])
    if meta in ("hidden", "all"):
        hidden = hidden.to("meta")
    if meta in ("weight", "all"):
        weight = weight.to("meta")
    if meta == "all":
        targets = targets.to("meta")
    name = "weight" if meta == "weight" else "hidden"
    with pytest.raises(ValueError, match=f"^{name} is a meta tensor, which holds no data: materialise it"):
        getattr(flce, function)(hidden, weight, targets)


@pytest.mark.parametrize("outputs", [None, 3, "entropy", ("entropy", None)])
def test_outputs_that_are_no_names_are_refused_naming_outputs(flce, outputs):
    hidden, weight, targets = torch.randn(4, 8), torch.randn(16, 8), torch.tensor([1, 2, 3, 4])
    with pytest.raises(TypeError, match=r"^outputs must be a tuple of names among \('log_probs', 'entropy'"):
        flce.fused_linear_log_probs(hidden, weight, targets, outputs=outputs)


def test_outputs_take_any_iterable_of_names(flce):
    """A list or a generator of names is read as the tuple of them: the same outputs, bit for bit."""
    hidden, weight, targets = torch.randn(4, 8), torch.randn(16, 8), torch.tensor([1, 2, 3, 4])
    as_tuple = flce.fused_linear_log_probs(hidden, weight, targets, outputs=("entropy",))
    as_generator = flce.fused_linear_log_probs(hidden, weight, targets, outputs=(n for n in ["entropy"]))
    assert torch.equal(as_tuple.entropy, as_generator.entropy) and as_generator.is_top1 is None
    expected = -(torch.log_softmax(hidden.double() @ weight.double().T, -1).exp()
                 * torch.log_softmax(hidden.double() @ weight.double().T, -1)).sum(-1)
    torch.testing.assert_close(as_tuple.entropy.double(), expected, rtol=1e-5, atol=1e-6)  # fp32 sums over V = 16


def test_the_package_shows_no_helper_modules(flce):
    """dir(flce) holds the public API and the package's own submodules, not the standard library's
    importlib (which the lazy ``trl`` submodule needs)."""
    public = [name for name in dir(flce) if not name.startswith("_")]
    assert "importlib" not in public
    assert set(flce.__all__) <= set(public)
    assert flce.trl.__name__ == f"{flce.__name__}.trl"  # still imported on first use
