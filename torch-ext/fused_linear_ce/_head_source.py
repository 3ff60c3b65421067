"""What a transformers causal LM's forward does between its backbone and its loss, read from its source.

``head_plan(cls)`` reads ``cls.forward`` statement by statement (its ``ast``, conditionals
flattened) and accepts it only if every statement that touches the inputs, the hidden states,
the logits, the labels or the loss is one that the fused loss reproduces:

- the backbone called (on the inputs as given: ``fused_forward`` passes them to it) and its last
  hidden state, cut by ``logits_to_keep`` (which training with labels keeps
  whole), optionally divided by a number (MiniCPM3's ``logits_scaling``);
- ``logits = self.<output embeddings>(hidden_states)`` (a cast, ``.float()`` or ``.contiguous()``
  around it change nothing: the fused loss accumulates in fp32), optionally times a number;
- the logits multiplied or divided by a number (Cohere's ``logit_scale``, Granite's
  ``logits_scaling``) and soft-capped, ``c * tanh(z / c)`` (Gemma's ``final_logit_softcapping``,
  RecurrentGemma's ``logits_soft_cap``);
- ``loss = self.loss_function(logits, labels, vocab_size, **kwargs)`` (transformers' ForCausalLMLoss);
- after it, a router's auxiliary loss under ``if output_router_logits:`` (``fused_forward``
  refuses a model that adds one), or a term under ``if self.<number> > 0:``, which the model
  must then have at 0 (Bamba's z-loss).

Any other statement on those values (a vocabulary cut, an offset of image tokens, a loop over
chunks, a head module before the output embeddings) makes the class refused, with that statement
quoted: a change in a later transformers release is refused rather than trained on another loss.
The numbers are attribute paths on the model (``self.config.final_logit_softcapping``), read
per model by ``plan_options``.
"""

import ast
import functools
import inspect
import re
import textwrap
from typing import NamedTuple

# The names whose statements must be understood: what flows into the backbone and from it to the loss.
_WATCHED = re.compile(r"\b(hidden_states|logits|lm_logits|labels|shift_labels|loss|input_ids|inputs_embeds|"
                      r"attention_mask|position_ids)\b")
# A number the forward reads off the model: an attribute path on self, with argument-less calls
# (``self.config.get_text_config().vocab_size``).
_PATH = r"self(?:\.\w+(?:\(\))?)+"
_LOGITS = r"(?:lm_)?logits"


class HeadPlan(NamedTuple):
    """The forward's head, as the fused loss reproduces it: ``head`` is the attribute of the output
    embeddings; ``steps`` are ("scale" | "divide" | "softcap", attribute path) in the order applied
    to the logits; ``zero`` are attribute paths that must be 0 (or None) on the model."""

    head: str
    steps: tuple[tuple[str, str], ...]
    zero: tuple[str, ...]


def _statements(body: list, guards: tuple[str, ...] = ()):
    """(statement text, the conditions it is under) for each statement, nested blocks flattened."""
    for node in body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # a docstring
        if isinstance(node, ast.If):
            test = ast.unparse(node.test)
            yield f"if {test}:", guards
            yield from _statements(node.body, (*guards, test))
            yield from _statements(node.orelse, (*guards, f"not ({test})"))
        elif isinstance(node, (ast.With, ast.For, ast.While, ast.Try)):
            yield ast.unparse(node).splitlines()[0], guards
            yield from _statements(node.body, guards)
        else:
            yield ast.unparse(node).replace("\n", " "), guards


def _loss_call_problem(statement: str, logits: str) -> str | None:
    """Why ``loss = self.loss_function(...)`` is not ForCausalLMLoss of the logits and labels as they are."""
    call = ast.parse(statement).body[0].value
    keywords = {k.arg: ast.unparse(k.value) for k in call.keywords if k.arg is not None}
    positional = [ast.unparse(a) for a in call.args]
    given = dict(zip(("logits", "labels", "vocab_size"), positional, strict=False)) | keywords
    if given.get("logits") != logits or given.get("labels") != "labels":
        return f"computes its loss of other logits or labels than its own: {statement}"
    # Keywords that ForCausalLMLoss(logits, labels, vocab_size, num_items_in_batch, ignore_index,
    # shift_labels, **kwargs) does not name land in its **kwargs, unread (XGLM's pad_token_id).
    own = set(given) & {"num_items_in_batch", "ignore_index", "shift_labels"}
    if own or len(positional) > 3:
        return f"passes its loss other arguments: {statement}"
    return None


def _read(statements: list) -> HeadPlan | str:
    """The plan of the flattened forward, or the first statement that the fused loss does not reproduce."""
    head, logits, steps, zero, local = None, None, [], [], {}
    loss_seen = False

    def number(text: str) -> str | None:  # an attribute path, or a local set from one
        text = local.get(text, text)
        return text if re.fullmatch(_PATH, text) else None

    i = 0
    while i < len(statements):
        text, guards = statements[i]
        i += 1
        m = re.fullmatch(rf"(\w+) = ({_PATH})", text)
        if m and not _WATCHED.fullmatch(m[1]):  # a local number: cap = self.config.logits_soft_cap
            local[m[1]] = m[2]
            continue
        if m := re.fullmatch(rf"if \((\w+) := ({_PATH})\) is not None:", text):
            local[m[1]] = m[2]
            continue
        if not _WATCHED.search(text) or text in ("loss = None", "if labels is not None:"):
            continue
        if re.fullmatch(rf"if ({_PATH}) is not None:", text) or text.startswith(("output = (", "return ")):
            continue  # a guard on a number (a None one is skipped), or the outputs
        if loss_seen:  # after the loss: only a guarded auxiliary term
            if not re.match(r"(loss \+?=|if |\w+ = )", text):
                return f"does more with the loss: {text}"
            if re.match(r"loss \+?=", text):
                if any("output_router_logits" in g for g in guards):
                    continue
                guard = next((m[1] for g in guards if (m := re.fullmatch(rf"({_PATH}) > 0", g))), None)
                if guard is None:
                    return f"adds to the loss: {text}"
                zero.append(guard)
            continue
        if head is None:
            call = re.fullmatch(r"(\w+)(?:: \w+)? = self(?:\.\w+)+\(.*\)", text)
            if call and not _WATCHED.fullmatch(call[1]):
                continue  # the backbone's call
            if re.fullmatch(r"hidden_states = (\w+|self(\.\w+)+\(.*\))(\.last_hidden_state|\[0\])", text):
                continue  # the backbone's last hidden state
            if text.startswith("if hidden_states.shape[1] == ") or re.fullmatch(
                    r"hidden_states = slice_logits_to_keep\((hidden_states|\w+\.last_hidden_state), logits_to_keep\)",
                    text):
                continue  # logits_to_keep: 0 in training, which keeps every position
            if m := re.fullmatch(rf"hidden_states = (?:hidden_states|\w+\.last_hidden_state) / ({_PATH})", text):
                steps.append(("divide", m[1]))
                continue
            if m := re.fullmatch(rf"({_LOGITS}) = self\.(\w+)\(hidden_states(?:\.to\([^()]*\))?\)"
                                 rf"(?:\.float\(\)|\.contiguous\(\))?(?: \* ({_PATH}))?", text):
                logits, head = m[1], m[2]
                if m[3]:
                    steps.append(("scale", m[3]))
                continue
            if not re.search(r"\b(hidden_states|logits|lm_logits)\b", text):
                return f"prepares its backbone's inputs otherwise than fused_forward passes them: {text}"
            return f"computes its logits otherwise than self.<output embeddings>(last hidden state): {text}"
        if text.startswith("loss = self.loss_function("):
            problem = _loss_call_problem(text, logits)
            if problem is not None:
                return problem
            loss_seen = True
            continue
        # logits = logits / c; logits = torch.tanh(logits); logits = logits * c: the soft cap
        if m := re.fullmatch(rf"{logits} = {logits}(?:\.float\(\))? / (\w+(?:\.\w+(?:\(\))?)*)", text):
            following = [s for s, _ in statements[i:i + 2]]
            if following == [f"{logits} = torch.tanh({logits})", f"{logits} = {logits} * {m[1]}"] and number(m[1]):
                steps.append(("softcap", number(m[1])))
                i += 2
                continue
            if number(m[1]):
                steps.append(("divide", number(m[1])))
                continue
        if (m := re.fullmatch(rf"{logits} = (?:nn\.functional|torch|F)\.tanh\({logits} / (\w+)\) \* (\w+)", text)) \
                and m[1] == m[2] and number(m[1]):
            steps.append(("softcap", number(m[1])))
            continue
        if (m := re.fullmatch(rf"{logits} = {logits} \* (\S+)", text)) and number(m[1]):
            steps.append(("scale", number(m[1])))
            continue
        return f"does with its logits what the fused loss does not reproduce: {text}"
    if head is None:
        return "computes no logits as self.<output embeddings>(last hidden state)"
    if not loss_seen:
        return "computes its loss without self.loss_function (transformers' ForCausalLMLoss)"
    kinds = [kind for kind, _ in steps]
    if kinds.count("softcap") > 1 or ("softcap" in kinds and kinds[kinds.index("softcap") + 1:]):
        return f"scales its logits after soft-capping them: {steps}"
    return HeadPlan(head, tuple(steps), tuple(zero))


@functools.lru_cache
def head_plan(cls: type) -> HeadPlan | str | None:
    """The ``HeadPlan`` of ``cls.forward``; or what the forward does that makes the fused loss another loss;
    None when the forward has no source to read (a frozen install)."""
    try:
        source = textwrap.dedent(inspect.getsource(cls.forward))
    except (OSError, TypeError):
        return None
    if "self.loss_function(" not in source:
        return "computes its loss without self.loss_function (transformers' ForCausalLMLoss)"
    function = ast.parse(source).body[0]
    if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    return _read(list(_statements(function.body)))


def read_path(model, path: str):
    """The value of an attribute path such as ``self.config.get_text_config().final_logit_softcapping``
    on ``model`` (``self``)."""
    value = model
    for part in path.split(".")[1:]:
        value = getattr(value, part.removesuffix("()"))
        if part.endswith("()"):
            value = value()
    return value


def plan_options(model, plan: HeadPlan) -> dict[str, float | None]:
    """``{"logit_scale", "softcap"}`` of ``plan``'s steps on ``model``: the scales multiply, the
    soft cap comes last (``_read`` refuses a scale after it); a None number is a skipped step."""
    logit_scale, softcap = 1.0, None
    for kind, path in plan.steps:
        value = read_path(model, path)
        if value is None:
            continue
        value = float(value)
        if kind == "softcap":
            softcap = value
        else:
            logit_scale = logit_scale * value if kind == "scale" else logit_scale / value
    return {"logit_scale": logit_scale, "softcap": softcap}
