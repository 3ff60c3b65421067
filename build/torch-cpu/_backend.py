"""The contract between the chunk loop (``_chunked``) and a backend: what each call takes and gives.

Two modules honour it: ``_triton_backend`` (the Triton kernels, on CUDA, or in Triton's CPU
interpreter) and ``_torch_backend`` (PyTorch, for CPU tensors). A backend is a module, so the
contract is written as ``Protocol`` classes whose methods stand for its functions (``self`` is
the module); ``tests/test_backends.py`` checks both modules against them, names and parameters.

Shapes: ``rows`` is a chunk's rows, ``V`` the weight's vocabulary rows (a slice of the whole
vocabulary under vocabulary parallelism), ``H`` the hidden size. "fp32" means the accumulation
dtype: fp64 for fp64 inputs.
"""

from typing import Any, Protocol, runtime_checkable

import torch

from ._options import LossOptions, RowResults, RowStats


@runtime_checkable
class Backend(Protocol):
    def hardware(self, device: torch.device) -> Any:
        """The device's facts for the plan (``_plan.Hardware``): which backend, the interpreter, the
        programs of a persistent round, the Gluon kernel's tile where it runs. The plan
        (``_plan``) makes every choice from them: chunks, row blocks, the factored gradient."""

    def targets_out_of_range(self, targets: torch.Tensor, vocab_size: int, ignore_index: int) -> torch.Tensor:
        """A [] int32 flag, 1 if a target [N] is neither in [0, vocab_size) nor ``ignore_index``."""

    def precompile(self, kind: str, device: torch.device) -> None:
        """Readies the kernels of a call of ``kind`` ("loss", "metrics", or "tokens:" and the
        per-token outputs' sorted names, comma-separated) on ``device``
        before its first launch; the Triton backend compiles them in parallel, forked processes."""

    def new_buffer(self, rows: int, vocab_size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The chunk buffer [rows, V] for inputs of ``dtype``, in the storage dtype that the
        backend's ``row_stats`` writes (the inputs' dtype, or fp32 for PyTorch's logits)."""

    def order_rows(self, targets: torch.Tensor, ignore_index: int, mean: bool) -> tuple:
        """The rows with a loss first: (order int64 [N], targets[order] int64 [N], their count
        int64 [1], d loss / d loss_i fp32 [N] of the ordered rows)."""

    def mean_grad_ratio(self, row_grad: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
        """[2] fp32: 1 if ``row_grad`` [N] is one value c on every row whose target [N] is not
        ``ignore_index`` (else 0), then -c / w, w = 1 / their count (both divisions rounded as
        PyTorch's: exactly 1 where c = -1 / count)."""

    def step_target_logits(self, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                           opts: LossOptions, bias: torch.Tensor | None = None,
                           rows: torch.Tensor | None = None) -> torch.Tensor | None:
        """Every row's target logit [N] fp32 (NaN where the target is not a column of this weight)
        in one call before a step's chunks, the value ``row_stats`` would compute for the row;
        with ``rows`` (int64 [N]) row i is hidden[rows[i]]. None where ``row_stats`` finds the
        target logits itself, chunk by chunk."""

    def row_stats(self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  targets: torch.Tensor, opts: LossOptions, shifted_out: torch.Tensor | None = None,
                  row_ref: torch.Tensor | None = None, loss_grad: torch.Tensor | None = None,
                  class_weight: torch.Tensor | None = None, target_logit: torch.Tensor | None = None,
                  return_metrics: bool = False, logit_sum: bool = False,
                  sum_sq: bool = False) -> tuple[RowStats, Any]:
        """Softmax statistics [rows] of hidden [rows, H] against weight [V, H] (+ bias [V]), and
        the state that ``grad_from_stored`` / ``row_factors`` take; ``shifted_out`` (a buffer)
        keeps what the gradient is made from; ``logit_sum`` and ``sum_sq`` add the rows' sums of
        logits and of squared exponentials (``RowStats``). Without a buffer, a ``row_ref`` takes
        the sums relative to it, as the factored sweep does (where ``factored_gradient``)."""

    def finalize(self, stats: RowStats, targets: torch.Tensor, opts: LossOptions, vocab_size: int,
                 out: RowResults, return_metrics: bool = False) -> None:
        """Per-row lse, loss (and metrics) [rows] written to ``out`` from merged statistics."""

    def grad_from_stored(self, buffer: torch.Tensor, state: Any, targets: torch.Tensor, lse: torch.Tensor,
                         loss_grad: torch.Tensor, opts: LossOptions,
                         bias_grad_acc: torch.Tensor | None) -> torch.Tensor:
        """Grad logits [rows, V] (d out / d raw logits) made in place in ``buffer``, once lse
        [rows] is known; adds their column sums to ``bias_grad_acc`` [V] fp32 unless None."""

    def kept_row_bytes(self, vocab_size: int, dtype: torch.dtype, has_softcap: bool) -> int:
        """Bytes that a row kept by the per-token forward takes until its backward: what
        ``row_stats`` stores into a buffer row (``new_buffer``) and the row's share of its state."""

    def grad_from_kept(self, buffer: torch.Tensor, state: Any, row_ref: torch.Tensor | None,
                       targets: torch.Tensor, lse: torch.Tensor, loss_grad: torch.Tensor,
                       lse_grad: torch.Tensor | None, entropy_grad: torch.Tensor | None, opts: LossOptions,
                       bias_grad_acc: torch.Tensor | None) -> torch.Tensor:
        """Grad logits [rows, V] of rows kept by the per-token forward, made in place in ``buffer``
        (what ``row_stats`` stored there, with its ``state``; with ``row_ref`` [rows] the factored
        sweep's exponentials) for the per-row coefficients of ``grad_logits``; no logit product.
        Adds their column sums to ``bias_grad_acc`` [V] fp32 unless None."""

    def grad_logits(self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    targets: torch.Tensor, lse: torch.Tensor, loss_grad: torch.Tensor,
                    lse_grad: torch.Tensor | None, opts: LossOptions, out: torch.Tensor,
                    bias_grad_acc: torch.Tensor | None, class_weight: torch.Tensor | None = None,
                    smooth_grad: torch.Tensor | None = None,
                    entropy_grad: torch.Tensor | None = None) -> torch.Tensor:
        """Recomputes a chunk's logits and writes its grad logits [rows, V] to ``out`` (returned);
        ``entropy_grad`` [rows] adds d out / d entropy_i's term (its -e_i H_i part in ``lse_grad``)."""

    def scale_(self, x: torch.Tensor, scale: torch.Tensor) -> None:
        """x *= scale in place (scale: a one-element fp32 tensor)."""

    def zero_rows(self, dst: torch.Tensor, rows: torch.Tensor) -> None:
        """dst[rows] = 0 in place (dst [*, C] with unit column stride, rows int64 [n])."""


@runtime_checkable
class FactoredBackend(Backend, Protocol):
    """A backend whose training chunks can keep exponentials and factor their gradient as
    diag(r) E' + diag(c) T (see ``_row_kernels``); called only where the plan (``_plan.factored_gradient``) says
    so."""

    def row_reference(self, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                      opts: LossOptions, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, target_logit) [rows] fp32: the reference of each row's exponentials (its target's
        logit, column 0 where it has none here) and the target's logit (NaN where none here);
        with ``rows`` (int64) row i is hidden[rows[i]]."""

    def row_factors(self, buffer: torch.Tensor, state: Any, row_max: torch.Tensor, row_ref: torch.Tensor,
                    lse: torch.Tensor, loss_grad: torch.Tensor, targets: torch.Tensor,
                    opts: LossOptions, take_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Makes the stored exponentials E' in place; returns (r, c) [rows] fp32 with
        G = diag(r) E' + diag(c) T: c is the target entry of the rows whose ``take_out`` flag
        [rows] int8 takes it out of the products (0 in E' there; ``_row_kernels._factor_rows``), 0
        elsewhere (None: every entry stays in)."""

    def factored_sweep(self, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, opts: LossOptions,
                       buffer: torch.Tensor, loss_grad: torch.Tensor, return_metrics: bool = False,
                       reference: tuple[torch.Tensor, torch.Tensor] | None = None) -> Any:
        """A factored chunk's sweep when ``weight`` is the whole vocabulary (no merge across
        shards): ``row_reference`` (unless given as ``reference``), then ``row_stats`` into
        ``buffer``; returns the state that ``factored_rows`` takes."""

    def factored_rows(self, sweep: Any, hidden: torch.Tensor, targets: torch.Tensor, opts: LossOptions,
                      buffer: torch.Tensor, loss_grad: torch.Tensor, out: RowResults,
                      scaled_hidden: torch.Tensor | None = None, return_metrics: bool = False,
                      take_out: torch.Tensor | None = None) -> tuple[RowStats, torch.Tensor, torch.Tensor]:
        """The rest of the chunk after ``factored_sweep``: the merge, ``finalize`` into ``out`` and
        ``row_factors`` in one, and with ``scaled_hidden`` [rows, H] also diag(r) hidden written
        there; ``take_out`` as in ``row_factors``. Returns (stats, r, c)."""

    def scale_rows(self, src: torch.Tensor, factor: torch.Tensor, dst: torch.Tensor,
                   dst_rows: torch.Tensor | None = None,
                   target_terms: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """dst[dst_rows] = factor[:, None] * src, with ``target_terms`` (c, targets, weight) also
        + c[:, None] * weight[targets], rounded once to dst's dtype; returns dst."""

    def take_out_flags(self, targets: torch.Tensor, vocab_size: int, ignore_index: int, rare_count: int,
                       improbable_count: int) -> torch.Tensor:
        """[N] int8 ``take_out`` flags from each row's target's count of rows: OUT_ALWAYS up to
        ``rare_count`` rows, OUT_IF_IMPROBABLE up to ``improbable_count``, else 0 (and 0 on rows
        without a target here)."""

    def add_target_rows(self, acc: torch.Tensor, target_grad: torch.Tensor, targets: torch.Tensor,
                        hidden: torch.Tensor, hidden_rows: torch.Tensor | None = None) -> None:
        """acc[t] += sum of target_grad[i] * hidden[hidden_rows[i]] over the rows i with
        targets[i] == t, in fp32 and one rounding into acc (grad_weight's target terms)."""
