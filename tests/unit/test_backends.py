"""Both backends honour the contract of ``_backend``: the same functions, with the same
parameters in the same order, as the chunk loop calls them."""

import inspect

import pytest
from conftest import submodule


def _parameters(function) -> list[tuple[str, object]]:
    return [(p.name, p.default) for p in inspect.signature(function).parameters.values() if p.name != "self"]


@pytest.mark.parametrize("name, factored", [("_triton_backend", True), ("_torch_backend", False)])
def test_backend_functions_match_the_protocol(flce, name, factored):
    contract = submodule(flce, "_backend")
    backend = submodule(flce, name)
    assert isinstance(backend, contract.Backend)
    assert isinstance(backend, contract.FactoredBackend) == factored
    protocol = contract.FactoredBackend if factored else contract.Backend
    members = [m for m in dir(protocol) if not m.startswith("_") and callable(getattr(protocol, m))]
    assert "row_stats" in members and ("row_factors" in members) == factored
    for member in members:
        assert _parameters(getattr(backend, member)) == _parameters(getattr(protocol, member)), member
