"""The plan (``_plan``): which pipeline, kernels and chunks a call takes, decided from its request,
shapes and the device's facts without running a kernel; the request's round trip through the
operators' schema; the speculation's re-arming.

The expected plans are worked out by hand from the rules the plan's docstrings state (the
numbers in each case's comment), not from the plan's code."""

import pytest
import torch
from conftest import submodule

# Settings whose defaults the plans below assume, whatever FLCE_CHUNK_ROWS and FLCE_BUFFER_MIB say.
DEFAULTS = dict(chunk_rows=None, buffer_mib=None, keep_mib=None)
LLAMA3 = dict(vocab_size=128256, hidden_size=4096)  # 256512 bytes a bf16 logit row, 16384 an fp32 hidden row

HOPPER = dict(backend="triton", programs=132, gluon_tile=(192, 256), capability=(9, 0))
AMPERE = dict(backend="triton", programs=108, capability=(8, 0))
INTERPRETER = dict(backend="triton", interpreting=True, programs=4)
TORCH = dict(backend="torch")

GRADS = dict(grad_hidden=True, grad_weight=True)

# (request, shape, hardware, plan()'s keywords, settings, the fields expected)
CASES = {
    # A Llama-3 step: 768 MiB / 256512 B -> 3072 rows, 2048 x 256512 / (256512 + 4 x 4096) -> 1920, cap
    # 1536; 6 chunks <= 8: no growth, no fp32 sum; the Gluon kernel sweeps (192-row tiles).
    "factored": (dict(GRADS), dict(n_rows=8192, **LLAMA3), HOPPER, {}, {},
                 dict(pipeline="factored", sweep="gluon", target_logit="reference", references_first=True,
                      row_order="targets", row_block=192, chunk_rows=1536, first_rows=1536, grown=False,
                      n_chunks=6, weight_sum="direct", take_out=2, sweep_tiles=None, tile_width=256)),
    # 32768 rows would take 22 chunks of 1536 and an fp32 sum: 8 chunks of ceil(4096 / 192) x 192 = 4224.
    "factored_grown": (dict(GRADS), dict(n_rows=32768, **LLAMA3), HOPPER, {}, {},
                       dict(pipeline="factored", chunk_rows=4224, grown=True, n_chunks=8, weight_sum="direct")),
    "factored_grouped": (dict(GRADS), dict(n_rows=32768, **LLAMA3), HOPPER, {}, dict(grow_chunks=False),
                         dict(chunk_rows=1536, grown=False, n_chunks=22, weight_sum="grouped", weight_group=8)),
    # V x H x 4 = 256000 B <= 64 MiB: a small head's 16 chunks of 256 rows summed in fp32 from the start.
    "fp32_from_start": (dict(GRADS), dict(n_rows=4096, vocab_size=1000, hidden_size=64), HOPPER, {},
                        dict(chunk_rows=256), dict(chunk_rows=256, n_chunks=16, weight_sum="fp32", weight_fp32=True)),
    "fp32_inputs": (dict(GRADS), dict(n_rows=4096, vocab_size=1000, hidden_size=64, dtype=torch.float32), HOPPER, {},
                    dict(chunk_rows=256), dict(pipeline="factored", sweep="tiles", row_block=128, weight_sum="direct",
                                               weight_group=None, tile_width=128)),
    "factored_no_gluon_training": (dict(GRADS), dict(n_rows=1024, **LLAMA3), HOPPER, {}, dict(gluon_training=False),
                                   dict(pipeline="factored", sweep="tiles", row_block=128)),
    "entries_in": (dict(GRADS), dict(n_rows=1024, **LLAMA3), HOPPER, {}, dict(rare_target=-1),
                   dict(pipeline="factored", take_out=None)),
    "no_weight_grad": (dict(grad_hidden=True), dict(n_rows=1024, **LLAMA3), HOPPER, {}, {},
                       dict(pipeline="factored", take_out=None, weight_sum="none")),
    # fp16 cannot hold the exponentials, a bias or a softcap is not one factor a row: the stored logits.
    "stored_fp16": (dict(GRADS), dict(n_rows=1024, dtype=torch.float16, **LLAMA3), HOPPER, {}, {},
                    dict(pipeline="stored", sweep="tiles", target_logit="product", references_first=False,
                         row_block=128, chunk_rows=1024, first_rows=1024)),
    "stored_bias": (dict(GRADS), dict(n_rows=1024, has_bias=True, **LLAMA3), HOPPER, {}, {},
                    dict(pipeline="stored", sweep="tiles", target_logit="product")),
    "stored_softcap": (dict(GRADS, softcap=30.0), dict(n_rows=1024, **LLAMA3), HOPPER, {}, {},
                       dict(pipeline="stored", sweep="tiles")),
    "factored_off": (dict(GRADS), dict(n_rows=1024, **LLAMA3), HOPPER, {}, dict(factored=False),
                     dict(pipeline="stored", target_logit="product")),
    # Two ranks of Llama-3's vocabulary: 2 x 1536 = 3072 (under 768 MiB's 6272 and the share's 3328);
    # the factored sweep's references per chunk, in 128-row blocks as every rank plans.
    "sharded": (dict(GRADS), dict(n_rows=8192, vocab_size=64128, hidden_size=4096, sharded=True, shards=2,
                                  planning_vocab_size=64128), HOPPER, {}, {},
                dict(pipeline="stored", sharded=True, target_logit="reference", references_first=False,
                     row_block=128, chunk_rows=3072, n_chunks=3)),
    # A forward of 1024 rows: one chunk of them (at most 21 tiles of 192), planned to fill rounds
    # of 501 tiles a block on 132 programs.
    "statistics_gluon": (dict(), dict(n_rows=1024, **LLAMA3), HOPPER, {}, {},
                         dict(pipeline="statistics", sweep="gluon", target_logit="product", row_order="targets",
                              row_block=192, chunk_rows=1024, first_rows=1024, sweep_tiles=(501, 132), n_chunks=0,
                              grads_in_forward=(False, False, False))),
    "statistics_metrics": (dict(return_metrics=True), dict(n_rows=1024, **LLAMA3), HOPPER, {}, {},
                           dict(pipeline="statistics", sweep="tiles", row_block=128)),
    "statistics_gluon_off": (dict(), dict(n_rows=1024, **LLAMA3), HOPPER, {}, dict(gluon=False),
                             dict(sweep="tiles", row_block=128)),
    # Without the Gluon kernel: 4096 rows fit one chunk; half of them first (2048, 16 blocks of 128:
    # of 16, 15, 14 blocks, 16 leaves the least of its last round idle, 125 tiles a block on 108).
    "statistics_ampere": (dict(), dict(n_rows=4096, vocab_size=32000, hidden_size=4096), AMPERE, {}, {},
                          dict(pipeline="statistics", sweep="tiles", row_block=128, chunk_rows=4096, first_rows=2048,
                               sweep_tiles=(125, 108))),
    "statistics_every_row": (dict(all_rows=True), dict(n_rows=4096, vocab_size=32000, hidden_size=4096), AMPERE,
                             {}, {}, dict(row_order="in place", first_rows=4096)),
    "statistics_captured": (dict(), dict(n_rows=4096, vocab_size=32000, hidden_size=4096, capturing=True), AMPERE,
                            {}, {}, dict(row_order="in place")),
    "statistics_ignored_computed": (dict(), dict(n_rows=4096, vocab_size=32000, hidden_size=4096), AMPERE, {},
                                    dict(skip_ignored=False), dict(row_order="in place")),
    "no_rows": (dict(GRADS), dict(n_rows=0, **LLAMA3), HOPPER, {}, {},
                dict(pipeline="statistics", row_order="in place", target_logit="sweep", n_chunks=0)),
    # Per-token outputs whose backward recomputes: kept rows; references as the factored step's, so
    # the kept chunks store the factored sweep's exponentials, which Hopper's Gluon kernel sweeps.
    "kept": (dict(outputs="log_probs"), dict(n_rows=1024, **LLAMA3), HOPPER, dict(keep=True), {},
             dict(pipeline="kept", sweep="gluon", target_logit="reference", references_first=True,
                  recompute_rows=1024, keep_mib=None, keep_rows=None)),
    "kept_budget": (dict(outputs="log_probs"), dict(n_rows=1024, **LLAMA3), HOPPER, dict(keep=True),
                    dict(keep_mib=3, keep_rows=13), dict(pipeline="kept", keep_mib=3, keep_rows=13)),
    "kept_off": (dict(outputs="log_probs"), dict(n_rows=1024, **LLAMA3), HOPPER, dict(keep=True), dict(keep_mib=0),
                 dict(pipeline="statistics", target_logit="reference", sweep="tiles")),
    "kept_fp16": (dict(outputs="log_probs"), dict(n_rows=1024, dtype=torch.float16, **LLAMA3), HOPPER,
                  dict(keep=True), {}, dict(pipeline="kept", target_logit="product")),
    "tokens_in_sweep": (dict(GRADS, outputs="log_probs"), dict(n_rows=1024, **LLAMA3), HOPPER, {}, {},
                        dict(pipeline="factored", grads_in_forward=(True, True, False), notes=None)),
    # A top-k loss whose forward makes its gradients: chunked as the Llama-3 step above (6 chunks of
    # 1536), each chunk's buffer the factored sweep's exponentials (Gluon), none of its target
    # entries out of the products (their grad logits are made from the buffer, not factored).
    "sparse": (dict(GRADS, outputs="log_probs"), dict(n_rows=8192, **LLAMA3), HOPPER, dict(sparse=True), {},
               dict(pipeline="sparse", sweep="gluon", target_logit="reference", references_first=True,
                    row_order="targets", row_block=192, chunk_rows=1536, first_rows=1536, n_chunks=6,
                    weight_sum="direct", take_out=None, grads_in_forward=(True, True, False))),
    # With a bias: the buffer holds z - tile_max, the target logits by one product first.
    "sparse_bias": (dict(GRADS, grad_bias=True, outputs="log_probs"), dict(n_rows=1024, has_bias=True, **LLAMA3),
                    HOPPER, dict(sparse=True), {},
                    dict(pipeline="sparse", sweep="tiles", target_logit="product", references_first=False,
                         row_block=128, chunk_rows=1024, grads_in_forward=(True, True, True))),
    # Backwards: every row with a gradient recomputed, in 128-row blocks, spread evenly.
    "recompute": (dict(GRADS), dict(n_rows=8192, **LLAMA3), HOPPER, dict(backward=True), {},
                  dict(pipeline="recompute", row_order="gradients", sweep="tiles", row_block=128, chunk_rows=1408,
                       first_rows=1408, n_chunks=6, grads_in_forward=(False, False, False))),
    "recompute_sharded": (dict(GRADS), dict(n_rows=1024, vocab_size=64128, hidden_size=4096, sharded=True, shards=2,
                                            planning_vocab_size=64128), HOPPER, dict(backward=True), {},
                          dict(pipeline="recompute", row_order="in place", sharded=True)),
    "recompute_kept": (dict(GRADS), dict(n_rows=1024, **LLAMA3), HOPPER, dict(backward=True, kept=True), {},
                       dict(pipeline="kept", row_order="kept")),
    # A kept backward's order as the last kept backward of its outputs found (``speculation``: what it
    # found, a gradient on every row the forward computed or not; "fresh": none seen): every computed
    # row, no host read ("forward"), or the rows with a gradient counted ("kept"); counted while captured.
    "kept_backward_fresh": (dict(GRADS, outputs="log_probs"), dict(n_rows=1024, **LLAMA3), HOPPER,
                            dict(backward=True, kept=True, speculation="fresh"), {},
                            dict(pipeline="kept", row_order="forward")),
    "kept_backward_every_row": (dict(GRADS, outputs="log_probs"), dict(n_rows=1024, **LLAMA3), HOPPER,
                                dict(backward=True, kept=True, speculation=True), {}, dict(row_order="forward")),
    "kept_backward_counted": (dict(GRADS, outputs="log_probs"), dict(n_rows=1024, **LLAMA3), HOPPER,
                              dict(backward=True, kept=True, speculation=False), {}, dict(row_order="kept")),
    "kept_backward_captured": (dict(GRADS, outputs="log_probs"), dict(n_rows=1024, capturing=True, **LLAMA3), HOPPER,
                               dict(backward=True, kept=True, speculation=True), {}, dict(row_order="kept")),
    # The PyTorch backend: 256 MiB / (5000 x 8 B) = 6710 rows, so one chunk of the 1000.
    "torch": (dict(GRADS), dict(n_rows=1000, vocab_size=5000, hidden_size=64, dtype=torch.float32), TORCH, {}, {},
              dict(backend="torch", pipeline="stored", sweep="torch", target_logit="sweep", row_block=128,
                   chunk_rows=1000, tile_width=None, sweep_tiles=None)),
    "torch_forward": (dict(), dict(n_rows=1000, vocab_size=5000, hidden_size=64, dtype=torch.float32), TORCH, {}, {},
                      dict(backend="torch", pipeline="statistics", sweep="torch", sweep_tiles=None)),
    "interpreter": (dict(GRADS), dict(n_rows=37, vocab_size=50, hidden_size=16, dtype=torch.float32), INTERPRETER,
                    {}, {}, dict(pipeline="factored", sweep="tiles", tile_width=32, chunk_rows=37)),
    "fp64": (dict(), dict(n_rows=37, vocab_size=50, hidden_size=16, dtype=torch.float64), AMPERE, {}, {},
             dict(pipeline="statistics", target_logit="sweep", tile_width=64)),
}


def _options_and_flags(request: dict) -> tuple[dict, dict]:
    option_names = ("ignore_index", "logit_scale", "softcap", "label_smoothing", "z_loss_scale")
    return ({k: v for k, v in request.items() if k in option_names},
            {k: v for k, v in request.items() if k not in option_names})


@pytest.mark.parametrize("case", CASES)
def test_the_plan_table(flce, tune, case):
    plan, options = submodule(flce, "_plan"), submodule(flce, "_options")
    request, shape, hardware, keywords, settings, expected = CASES[case]
    tune(**{**DEFAULTS, **settings})
    option_values, flags = _options_and_flags(request)
    shape = {"dtype": torch.bfloat16, **shape}
    if "speculation" in keywords:  # a Speculation that found it for the request's outputs, or a fresh one
        found, speculation = keywords["speculation"], plan.Speculation()
        if found != "fresh":
            speculation.found(flags.get("outputs", ""), found)
        keywords = {**keywords, "speculation": speculation}
    chosen = plan.plan(options.Request(options.LossOptions(**option_values), **flags), plan.Shape(**shape),
                       plan.Hardware(**hardware), **keywords)
    expected = dict(expected)
    if expected.pop("notes", 1) is None:  # (the gradients of the mean, for the per-token outputs)
        assert chosen.notes == ("gradients of the mean",)
    got = {name: getattr(chosen, name) for name in expected}
    assert got == expected
    assert chosen.pipeline in plan.PIPELINES
    text = chosen.explain()
    assert f"pipeline: {chosen.pipeline}" in text and f"sweep kernel: {chosen.sweep}" in text


def test_the_table_reaches_every_pipeline_and_choice(flce):
    """Every pipeline, sweep kernel, target-logit source, row order and grad_weight sum is some case's."""
    plan = submodule(flce, "_plan")
    reached = {}
    for _, _, _, _, _, expected in CASES.values():
        for name in ("pipeline", "sweep", "target_logit", "row_order", "weight_sum"):
            if name in expected:
                reached.setdefault(name, set()).add(expected[name])
    assert reached["pipeline"] == set(plan.PIPELINES)
    assert reached["sweep"] == {"gluon", "tiles", "torch"}
    assert reached["target_logit"] == {"reference", "product", "sweep"}
    assert reached["row_order"] == {"targets", "gradients", "kept", "forward", "in place"}
    assert reached["weight_sum"] == {"none", "direct", "fp32", "grouped"}


def test_a_plan_in_words_and_as_a_dict(flce, tune):
    plan, options = submodule(flce, "_plan"), submodule(flce, "_options")
    tune(**DEFAULTS)
    request = options.Request(options.LossOptions(), grad_hidden=True, grad_weight=True)
    chosen = plan.plan(request, plan.Shape(8192, 128256, 4096, torch.bfloat16), plan.Hardware(**HOPPER))
    assert chosen.explain().splitlines()[:4] == [
        "backend: triton", "pipeline: factored", "gradients in the forward: hidden, weight",
        "sweep kernel: gluon, 256-column tiles"]
    record = chosen.as_dict()
    assert record["chunk_rows"] == 1536 and record["pipeline"] == "factored" and "notes" not in record


@pytest.mark.parametrize("request_fields", [
    dict(),
    dict(options=dict(ignore_index=7, logit_scale=0.5, softcap=30.0, label_smoothing=0.1, z_loss_scale=1e-4,
                      total_vocab_size=1000, vocab_start=500), reduction="sum", return_metrics=True,
         grad_hidden=True, grad_bias=True, all_rows=True),
    dict(options=dict(softcap=None), reduction="none", outputs="entropy,log_probs", logit_sum=True, sum_sq=True,
         grad_weight=True),
])
def test_a_request_round_trips_through_the_schema(flce, request_fields):
    """encode -> decode gives the request back, as many values as the schema has arguments, each a
    value of its schema type."""
    options = submodule(flce, "_options")
    fields = dict(request_fields)
    request = options.Request(options.LossOptions(**fields.pop("options", {})), **fields)
    encoded = request.encode()
    schema = options.Request.schema().split(", ")
    assert len(encoded) == len(schema)
    python_types = {"int": int, "float": float, "str": str, "bool": bool}
    for value, argument in zip(encoded, schema, strict=True):
        kind, _ = argument.split(" ")
        assert (value is None and kind.endswith("?")) or type(value) is python_types[kind.rstrip("?")], argument
    assert options.Request.decode(encoded) == request


def test_a_process_group_travels_by_name_through_the_schema_only(flce, monkeypatch):
    """Encoded, the group is its registered name (a ProcessGroup is no schema type); decoded, the
    group registered under it."""
    options, distributed = submodule(flce, "_options"), submodule(flce, "_distributed")

    class Group:
        group_name = "7"

    group = Group()
    monkeypatch.setattr(distributed, "resolve_group", lambda name: group if name == "7" else None)
    request = options.Request(options.LossOptions(group=group, vocab_start=64, total_vocab_size=128))
    encoded = request.encode()
    assert "7" in encoded and group not in encoded
    assert options.Request.decode(encoded) == request


def test_the_plain_data_has_only_constant_defaults(flce):
    """Every default of the dataclasses that traced calls build is None, a bool, a number or a string:
    torch 2.11's compiler wraps an ``__init__``'s defaults without a source and gives up on any other
    object (a ``LossOptions()`` default made every compiled call fail there, not under torch 2.13)."""
    options = submodule(flce, "_options")
    from dataclasses import MISSING, fields, is_dataclass

    classes = [value for value in vars(options).values()
               if isinstance(value, type) and is_dataclass(value) and value.__module__ == options.__name__]
    assert {"LossOptions", "Request"} <= {cls.__name__ for cls in classes}
    for cls in classes:
        for f in fields(cls):
            assert f.default_factory is MISSING, (cls.__name__, f.name)
            assert f.default is MISSING or f.default is None or type(f.default) in (bool, int, float, str), \
                (cls.__name__, f.name, f.default)


def test_the_operators_have_named_returns(flce):
    """The loss and per-token operators' schemas name their outputs as the NamedTuples do."""
    ops, options = submodule(flce, "_ops"), submodule(flce, "_options")
    namespace = getattr(torch.ops, ops.NAMESPACE)
    for op, outputs in ((namespace.forward, options.LossOutputs), (namespace.token_forward, options.TokenOutputs),
                        (namespace.backward, options.Gradients)):
        assert tuple(r.name for r in op.default._schema.returns) == outputs._fields


def test_the_loss_makes_its_gradients_in_the_forward_where_the_backward_only_scales_them(flce):
    plan = submodule(flce, "_plan")

    def rule(needs=(True, True, False), reduction="mean", return_lse=False, dtype=torch.bfloat16, class_weight=False,
             label_smoothing=0.0, z_loss_scale=0.0):
        return plan.loss_grads_in_forward(needs, reduction, return_lse, dtype, class_weight, label_smoothing,
                                          z_loss_scale)

    assert rule() == (True, True, False) and rule(reduction="sum") == (True, True, False)
    assert rule(reduction="none") == rule(return_lse=True) == rule(dtype=torch.float64) == (False,) * 3
    assert rule(class_weight=True) == (True, True, False)  # weighted rows alone: the stored pass weights them
    assert rule(class_weight=True, label_smoothing=0.1) == rule(class_weight=True, z_loss_scale=1e-4) == (False,) * 3
    assert rule(needs=(False, False, False)) == (False,) * 3


def test_a_top_k_loss_makes_its_gradients_in_the_forward_where_its_upstream_is_a_scalar(flce, tune):
    plan, options = submodule(flce, "_plan"), submodule(flce, "_options")

    def rule(needs=(True, True, False), reduction="mean", add_tail=True, dtype=torch.bfloat16, n_rows=8, eager=True):
        return plan.sparse_grads_in_forward(needs, reduction, add_tail, dtype, n_rows, eager)

    assert rule() == rule(reduction="sum") == (True, True, False)
    assert rule(needs=(False, True, True)) == (False, True, True)
    assert rule(reduction="none") == rule(add_tail=False) == rule(dtype=torch.float64) == (False,) * 3
    assert rule(n_rows=0) == rule(eager=False) == rule(needs=(False,) * 3) == (False,) * 3
    tune(**DEFAULTS)
    request = options.Request(options.LossOptions(), grad_hidden=True, grad_weight=True, reduction="none",
                              outputs="log_probs")
    chosen = plan.plan(request, plan.Shape(8192, 128256, 4096, torch.bfloat16), plan.Hardware(**HOPPER), sparse=True)
    lines = chosen.explain().splitlines()
    assert lines[1:3] == ["pipeline: sparse", "gradients in the forward: hidden, weight"]
    assert any(line.startswith("sparse loss: ") for line in lines)
    assert chosen.notes == ("gradients of the top-k loss on the (N, K) log-probs, for an upstream of 1",)


def test_a_kept_backward_counts_its_rows_only_after_one_found_rows_without_gradient(flce):
    """A kept backward takes every row its forward computed, with no host read, unless the last one
    of the same outputs found rows without gradient: a fresh key takes them all; a backward's check
    queued on the device (a host flag) or its counts read on the host decide the next; keys are
    apart; a captured backward counts. The plan says which in words."""
    plan, options = submodule(flce, "_plan"), submodule(flce, "_options")
    speculation = plan.Speculation()

    def kept_backward(key="entropy,log_probs", capturing=False):
        return plan.plan(options.Request(options.LossOptions(), grad_hidden=True, grad_weight=True, outputs=key),
                         plan.Shape(1024, 128256, 4096, torch.bfloat16, capturing=capturing), plan.Hardware(**HOPPER),
                         backward=True, kept=True, speculation=speculation)

    assert kept_backward().row_order == "forward"
    speculation.recheck("entropy,log_probs", (torch.tensor([0.0]), None))  # queued: rows without gradient
    assert kept_backward().row_order == "kept" and kept_backward("log_probs").row_order == "forward"
    speculation.found("entropy,log_probs", True)  # counted on the host: every computed row has one
    assert kept_backward().row_order == "forward" and kept_backward(capturing=True).row_order == "kept"
    assert "no host read" in kept_backward().explain()
    speculation.found("entropy,log_probs", False)
    assert "counted on the host" in kept_backward().explain()


def test_the_speculation_re_arms_after_a_backward_finds_equal_weights_again(flce):
    """A fresh key speculates; a backward's unequal verdict turns it off; while off, a backward's
    queued check (a host flag) decides the next forward; ``grad_in_forward`` overrides it."""
    plan = submodule(flce, "_plan")
    speculation = plan.Speculation()

    def in_forward(grad_in_forward=None, allowed=True):
        return plan.token_grads_in_forward((True, True, False), allowed, grad_in_forward, speculation, "log_probs")

    assert in_forward() == (True, True, False)
    speculation.found("log_probs", False)
    assert speculation.off("log_probs") and in_forward() == (False,) * 3
    assert in_forward(grad_in_forward=True) == (True, True, False)  # the caller decides this call
    speculation.recheck("log_probs", (torch.tensor([0.0]), None))  # a later backward: still unequal
    assert in_forward() == (False,) * 3
    speculation.recheck("log_probs", (torch.tensor([1.0]), None))  # equal again: re-armed
    assert in_forward() == (True, True, False)
    assert in_forward(allowed=False) == (False,) * 3 and in_forward(grad_in_forward=False) == (False,) * 3
    assert speculation.speculates("other")  # keys are apart
    divergence = plan.Speculation()
    assert plan.divergence_grads_in_forward((True, False, False), 8, divergence) == (True, False, False)
    assert plan.divergence_grads_in_forward((True, False, False), 0, divergence) == (False,) * 3
    divergence.found("", False)
    assert plan.divergence_grads_in_forward((True, True, False), 8, divergence) == (False,) * 3
