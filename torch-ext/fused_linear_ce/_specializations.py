"""The Triton specialisations that each kind of call compiles, per GPU (``_precompile``).

Written by ``scripts/record_specializations.py`` on the GPU; do not edit by hand."""

RECORDED: dict = {}
