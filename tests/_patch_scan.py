"""Every causal-LM class of the installed transformers, built tiny, against ``patch_forward``.

``tiny_model(model_type)`` builds the class that ``AutoModelForCausalLM`` makes for a model type
from its default config with every size shrunk (2 layers, hidden 32, vocab 128, 4 experts...) and
the final-logit options set to values that change the loss (a soft cap of 2, a scale of 0.5), so
that a head the fused loss did not reproduce shows. ``compare`` runs the model's own forward and
the patched one and returns the largest relative differences of the loss and the gradients, or
the refusal. The test is tests/integrations/test_patch_scan.py.

Run as a script, it scans every model type of transformers' MODEL_FOR_CAUSAL_LM_MAPPING, each
refused (by its class or its model, with the reason), or built tiny and compared with its own
forward (loss and gradients, fp32 on the CPU), or listed as not built with the error, and writes
the listing, tests/integrations/patch_scan.json (which the test checks against a fresh scan), and
docs/patch-scan.md:

    python tests/_patch_scan.py
"""

import ast
import inspect
import json
import os
import re
import sys
import textwrap
import warnings
from pathlib import Path

import torch

VOCAB = 128
SIZES = {  # a config attribute -> its tiny value (applied to the text, vision and audio configs alike)
    **dict.fromkeys(("hidden_size", "d_model", "n_embd", "embed_dim", "dim", "model_dim", "lru_width",
                     "hidden_dim", "projector_hidden_size", "embedding_size"), 32),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "n_inner", "d_ff", "ffn_hidden_size", "vision_intermediate_size",
                     "mlp_hidden_size", "intermediate_size_mlp"), 64),
    **dict.fromkeys(("moe_intermediate_size", "shared_expert_intermediate_size", "expert_intermediate_size",
                     "moe_shared_expert_intermediate_size", "ffn_hidden_size_moe", "hidden_size_per_layer_input"), 16),
    **dict.fromkeys(("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers", "encoder_layers",
                     "depth", "num_encoder_layers", "num_decoder_layers", "text_num_hidden_layers"), 2),
    **dict.fromkeys(("num_attention_heads", "n_head", "num_heads", "decoder_attention_heads", "encoder_attention_heads",
                     "n_heads", "attention_heads"), 4),
    # as many as the query heads: multi-head latent attention (DeepSeek-V3) takes no fewer
    **dict.fromkeys(("num_key_value_heads", "num_kv_heads", "multi_query_group_num", "n_kv_heads"), 4),
    **dict.fromkeys(("head_dim", "kv_channels", "qk_head_dim", "v_head_dim", "qk_nope_head_dim", "qk_rope_head_dim",
                     "attention_head_dim", "mamba_d_head", "mamba_head_dim", "linear_key_head_dim",
                     "linear_value_head_dim"), 8),
    **dict.fromkeys(("kv_lora_rank", "q_lora_rank"), 16),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), 4),
    **dict.fromkeys(("num_experts_per_tok", "moe_topk", "top_k", "num_selected_experts", "moe_k"), 2),
    **dict.fromkeys(("n_shared_experts", "num_shared_experts"), 1),
    **dict.fromkeys(("vocab_size", "text_vocab_size", "vocab_size_per_layer_input"), VOCAB),
    **dict.fromkeys(("state_size", "mamba_d_state", "ssm_state_size", "d_state", "time_step_rank"), 8),
    **dict.fromkeys(("mamba_n_heads", "num_linear_key_heads", "num_linear_value_heads", "linear_num_key_heads",
                     "linear_num_value_heads", "n_groups", "mamba_n_groups"), 2),
    "max_position_embeddings": 128,
    "image_size": 32, "patch_size": 8, "num_channels": 3,
}
# Final-logit options at values that move the loss: a head that the fused loss does not reproduce shows.
SENSITIVE = {"final_logit_softcapping": 2.0, "logits_soft_cap": 2.0, "output_logit_soft_cap": 2.0, "logit_scale": 0.5,
             "logits_scaling": 4.0, "lm_head_multiplier": 0.5, "logits_mup_width_multiplier": 2.0,
             "z_loss_coefficient": 0.0}
OFF = {"output_router_logits": False, "use_cache": False, "tie_word_embeddings": False,
       **{k: 0.0 for k in ("hidden_dropout", "attention_dropout", "hidden_dropout_prob", "dropout",
                           "attention_probs_dropout_prob", "resid_pdrop", "embd_pdrop", "attn_pdrop")}}
# Sizes left None by a default config that its model then needs (head_dim of Ministral, HunYuan).
NEEDED = ("head_dim", "num_key_value_heads")
# model type -> sizes that must agree with each other beyond the shrunk ones
OVERRIDES = {
    "bamba": {"mamba_expand": 2, "mamba_d_head": 8, "mamba_n_heads": 8},
    "granitemoehybrid": {"mamba_expand": 2, "mamba_d_head": 8, "mamba_n_heads": 8},
    "mamba2": {"num_heads": 8, "head_dim": 8, "expand": 2},
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},
    "gptj": {"rotary_dim": 4},
    "codegen": {"rotary_dim": 4},
    "gemma3n_text": {"num_kv_shared_layers": 0},
}
TOO_LARGE = 4_000_000  # parameters: the shrinking missed a size


def _tiny_values(defaults: dict) -> dict:
    """The keyword arguments that shrink a config of these default values (nested configs too)."""
    values = {}
    for key, value in defaults.items():
        if key == "per_layer_config" and isinstance(value, dict):  # {layer index: its own sizes}
            values[key] = {k: {**v, **_tiny_values({"head_dim": v.get("head_dim")})} for k, v in value.items()
                           if int(k) < 2}
        elif isinstance(value, dict) and ("model_type" in value or key.endswith("_config")):
            values[key] = {**value, **_tiny_values(value)}
        elif key in SIZES and isinstance(value, int) and not isinstance(value, bool) and value > SIZES[key]:
            values[key] = SIZES[key]
        elif key in NEEDED and value is None:
            values[key] = SIZES[key]
        elif key in SENSITIVE and value is not None:
            values[key] = SENSITIVE[key]
        elif key in OFF and type(value) is type(OFF[key]):
            values[key] = OFF[key]
        elif key.endswith("token_id") and isinstance(value, int) and value >= VOCAB:
            values[key] = VOCAB - 1 - len([k for k in values if k.endswith("token_id")]) % 8
        elif key in ("layer_types", "block_types", "layers_block_type") and isinstance(value, list):
            values[key] = value[:2]
        elif key in SIZES and isinstance(value, list) and all(isinstance(v, int) for v in value):  # one per layer
            values[key] = [min(v, SIZES[key]) for v in value[:2]]
        elif isinstance(value, list) and len(value) == defaults.get("num_hidden_layers", -1):  # one per layer
            values[key] = value[:2]
    return values


def causal_lm_class(model_type: str):
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])


def tiny_config(model_type: str):
    """The default config of a model type with every size shrunk (``_tiny_values``, ``OVERRIDES``)."""
    from transformers import AutoConfig

    cls = causal_lm_class(model_type)
    defaults = AutoConfig.for_model(model_type).to_dict()
    config = AutoConfig.for_model(model_type, **{**_tiny_values(defaults), **OVERRIDES.get(model_type, {})})
    if not isinstance(config, cls.config_class):  # a text model under a multimodal model type (Llama-4, Qwen3.5)
        config = config.get_text_config()
    return config


def meta_model(model_type: str):
    """The tiny model on the meta device (no data): what ``patch_forward`` checks, without the cost."""
    with torch.device("meta"):
        return causal_lm_class(model_type)(tiny_config(model_type))


def tiny_model(model_type: str):
    """(model class, a float32 tiny model in eval mode) for a model type; raises what building raised,
    or a RuntimeError if the shrunk model is still large."""
    cls, config = causal_lm_class(model_type), tiny_config(model_type)
    size = sum(p.numel() for p in meta_model(model_type).parameters())
    if size > TOO_LARGE:
        raise RuntimeError(f"{size / 1e6:.0f}M parameters after shrinking the default config")
    torch.manual_seed(0)
    model = cls(config).float().eval()
    head = model.get_output_embeddings()
    if head is not None and getattr(head, "weight", None) is not None:
        with torch.no_grad():  # peaked logits (the default init gives flat ones): the head's transforms matter
            head.weight.normal_(0.0, 0.5)
    return cls, model


def tiny_batch(seq: int = 8, vocab: int = VOCAB) -> dict:
    """Two rows of ``seq`` tokens below the special ids that ``_tiny_values`` sets, labels ignored at the start."""
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, vocab - 16, (2, seq), generator=g)
    labels = input_ids.clone()
    labels[0, :3] = -100
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": labels}


def _loss_and_grads(model, batch: dict, **kwargs):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    loss = model(**batch, **kwargs).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def compare(flce, model, vocab: int = VOCAB) -> dict:
    """``{"refused": reason}``, or ``{"loss", "fused_loss", "grad_rel_diff"}``: the own and the fused
    loss, and the largest difference of a gradient relative to that parameter's largest gradient
    (floored at 1e-4 of the largest gradient of all: some are 0 but for rounding, a bias of the keys
    under the softmax's shift invariance)."""
    batch = tiny_batch(vocab=vocab)
    own_loss, own_grads = _loss_and_grads(model, batch)
    try:
        flce.patch_forward(model)
    except ValueError as refusal:
        return {"refused": str(refusal)}
    try:
        fused_loss, fused_grads = _loss_and_grads(model, batch, fused_loss=True)
    except ValueError as refusal:  # refused at the call (a router loss, a term the model adds)
        return {"refused": str(refusal)}
    finally:
        flce.unpatch_forward(model)
    largest = max(float(g.abs().max()) for g in own_grads.values())
    worst = 0.0
    for name, grad in own_grads.items():
        fused = fused_grads.get(name, torch.zeros_like(grad))
        scale = max(float(grad.abs().max()), 1e-4 * largest)
        worst = max(worst, float((fused - grad).abs().max()) / scale)
    return {"loss": float(own_loss), "fused_loss": float(fused_loss), "grad_rel_diff": worst,
            "extra_grads": sorted(fused_grads.keys() - own_grads.keys())}


def forward_key(cls: type) -> str:
    """``cls.forward`` as code, without its docstring, annotations and output class names: the model
    types of one key run the same head code (36 Llama-like ones share one), and so one of them
    built and compared stands for all (``scan(..., numbers=False)`` checks the others' models)."""
    function = ast.parse(textwrap.dedent(inspect.getsource(cls.forward))).body[0]
    body = function.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        function.body = body[1:]
    function.returns = None
    for node in ast.walk(function):
        if isinstance(node, ast.arg):
            node.annotation = None
        elif isinstance(node, ast.AnnAssign):
            node.annotation = ast.Name("T")
    return re.sub(r"\b\w*(CausalLMOutput|ModelOutput)\w*\b", "Output", ast.unparse(function))


def scan(flce, model_type: str, numbers: bool = True) -> dict:
    """One model type: ``{"refused": reason}`` (by its class, without building it, or by the model),
    ``{"not_built": why}``, or ``compare``'s numbers; with ``numbers=False``, the model is built on
    the meta device and only ``patch_forward``'s checks run: ``{"accepted": True}`` if it passes."""
    cls = causal_lm_class(model_type)
    try:
        flce.patch_forward(cls)
    except ValueError as refusal:
        return {"refused": str(refusal)}
    flce.unpatch_forward(cls)
    if not numbers:
        try:
            model = meta_model(model_type)
        except Exception as error:  # noqa: BLE001 (any failure to build the default config, shrunk)
            return {"not_built": f"{type(error).__name__}: {error}".splitlines()[0][:160]}
        try:
            flce.patch_forward(model)
        except ValueError as refusal:
            return {"refused": str(refusal)}
        return {"accepted": True}
    try:
        _, model = tiny_model(model_type)
        model(**{k: v for k, v in tiny_batch().items() if k != "labels"})  # its own forward runs
    except Exception as error:  # noqa: BLE001 (any failure to build or run the default config, shrunk)
        first_line = f"{type(error).__name__}: {error}".splitlines()[0]
        return {"not_built": first_line[:160]}
    return compare(flce, model)


# fp32 throughout: the backbone is the same computation in both, and the heads differ only in how
# the (tokens, vocab) sums are associated (chunks of rows and of the vocabulary), ~1e-6 relative;
# a head that is not reproduced moves them by far more (a soft cap of 2: 1e-3 on the loss, 10% on
# the gradients).
LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-4


def matches(outcome: dict) -> bool:
    """Whether ``compare``'s numbers say the patched model is the model's own."""
    return (abs(outcome["fused_loss"] - outcome["loss"]) <= LOSS_RTOL * abs(outcome["loss"])
            and outcome["grad_rel_diff"] <= GRAD_RTOL and not outcome["extra_grads"])


# ---- the listing of every model type (run as a script) -------------------------------------
ROOT = Path(__file__).resolve().parents[1]
LISTING = ROOT / "tests" / "integrations" / "patch_scan.json"
DOC = ROOT / "docs" / "patch-scan.md"


def _reason(refusal: str) -> str:
    """What a refusal says about the class, after patch_forward's general sentence; table-safe."""
    return refusal.split(": ", 1)[-1].replace("|", "/")


def _markdown(listing: dict, names: dict) -> str:
    verified = listing["verified"]
    lines = [
        "# `patch_forward` on every causal-LM class of transformers",
        "",
        f"Generated by `python tests/_patch_scan.py` with transformers {listing['transformers']} and torch "
        f"{listing['torch']}; checked by `tests/integrations/test_patch_scan.py` (which compares one model type of "
        "each distinct forward and runs `patch_forward`'s checks on the others). Each model type of "
        "`MODEL_FOR_CAUSAL_LM_MAPPING` is refused (the reason is `patch_forward`'s error), or built tiny from its "
        "default config (2 layers, hidden 32, vocab 128, the final-logit options at values that move the loss) "
        "and its patched loss and gradients compared with its own forward's (fp32, CPU), or not built.",
        "",
        f"{len(verified)} verified, {len(listing['refused'])} refused, {len(listing['not_built'])} not built.",
        "",
        "## Refused",
        "",
        "| model type | class | why |",
        "|---|---|---|",
        *(f"| {t} | {names[t]} | {_reason(why)} |" for t, why in listing["refused"].items()),
        "",
        "## Not built (the default config, shrunk, does not build or run)",
        "",
        "| model type | class | error |",
        "|---|---|---|",
        *(f"| {t} | {names[t]} | {why.replace('|', '/')} |" for t, why in listing["not_built"].items()),
        "",
        "## Verified (patched loss and gradients equal the model's own)",
        "",
        ", ".join(f"{t} ({names[t]})" for t in verified),
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    os.environ["TRITON_INTERPRET"] = "0"  # the PyTorch path: what is scanned is the head, not the kernel
    import transformers
    from kernels import get_local_kernel
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    flce = get_local_kernel(ROOT / "build" / "torch-cpu")
    listing = {"transformers": transformers.__version__, "torch": torch.__version__.split("+")[0],
               "verified": [], "refused": {}, "not_built": {}}
    mismatched = []
    for model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        outcome = scan(flce, model_type)
        if "refused" in outcome:
            listing["refused"][model_type] = outcome["refused"]
        elif "not_built" in outcome:
            listing["not_built"][model_type] = outcome["not_built"]
        elif matches(outcome):
            listing["verified"].append(model_type)
        else:
            mismatched.append(model_type)
        print(model_type, outcome, flush=True)
    if mismatched:  # a silent wrong loss: patch_forward must refuse these, no listing is written
        print(f"patched models that do not match their own loss: {mismatched}", file=sys.stderr)
        return 1
    LISTING.write_text(json.dumps(listing, indent=1) + "\n")
    DOC.write_text(_markdown(listing, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))
    return 0


if __name__ == "__main__":
    sys.exit(main())
