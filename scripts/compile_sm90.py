"""Compiles the logit kernels for Hopper (sm_90) without a GPU: the statistics sweep (modes 0, 1, 3) and the
gradient (mode 2), persistent, with the
copy engine (TMA), through Triton's own compiler, so that a kernel the interpreter runs but the
GPU compiler refuses (an MLIR pass failure, a static assertion) shows up on any machine. With
``--row-kernels`` also the per-row kernels (merge, finalize, factors, the fused factored pass,
the tensor-core target logit, the row scaling, grad_weight's target segments and their keys, the
target counts and flags, the targets' range check, the rows' order, the skipped rows' zeros) with
their flags on and off, at their launches' block sizes and specializations (unit strides,
divisibility), marked "wgmma" where their PTX has Hopper's tensor-core products, with the bytes
ptxas spills to local memory ("spills=N"); with ``--gluon`` also the statistics kernel in
Gluon, with and without the training sweep's stored exponentials.

    TRITON_INTERPRET=0 python scripts/compile_sm90.py [--modes 0,1,2,3] [--flags HAS_BIAS=1,...] [--row-kernels]
        [--gluon]

Prints one line per variant: "ok <shared memory bytes>" or the error; exits 1 on any error.
"""

import argparse
import inspect
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "torch-ext"))
from fused_linear_ce import _elementwise_kernels, _row_kernels, _target_kernels, _tile_kernels  # noqa: E402

KERNEL_MODULES = (_tile_kernels, _row_kernels, _target_kernels, _elementwise_kernels)

BLOCK_N, BLOCK_V, BLOCK_K = 128, 256, 64  # the tuned configuration for bf16 on sm_90
POINTERS = {"targets_ptr": "*i64", "tile_argmax_ptr": "*i32"}  # others: fp32, or bf16 for the inputs
INPUTS = {"hidden_ptr": [BLOCK_N, BLOCK_K], "weight_ptr": [BLOCK_V, BLOCK_K], "out_ptr": [BLOCK_N, BLOCK_V]}
INTEGERS = ("n_rows", "vocab_size", "hidden_size", "group_rows")
FLOATS = ("logit_scale", "softcap", "label_smoothing", "z_loss_scale", "inv_vocab_size")
# The launches' flags, as this script's --flags name them, and the arguments each one makes present
# (absent arguments are None, a constant); modes 0, 1 and 3 are the statistics kernel's (0: no
# buffer, 1: z - tile max stored, 3: the factored sweep's exponentials), mode 2 the gradient kernel.
STATS_FLAGS = {"HAS_BIAS": ("bias_ptr",), "HAS_SOFTCAP": ("softcap",), "HAS_LOGIT_SCALE": ("logit_scale",),
               "RETURN_METRICS": ("tile_entropy_ptr", "tile_argmax_ptr"), "HAS_SMOOTHING": ("tile_logit_sum_ptr",),
               "HAS_CLASS_WEIGHT": ("class_weight_ptr",), "SUM_SQ": ("tile_sum_sq_ptr",),
               "PICK_TARGET": ("target_logit_ptr",), "ROW_REFERENCE": ("row_ref_ptr",)}
GRAD_FLAGS = {"HAS_BIAS": ("bias_ptr",), "HAS_SOFTCAP": ("softcap",), "HAS_LOGIT_SCALE": ("logit_scale",),
              "HAS_SMOOTHING": ("label_smoothing",), "HAS_Z_LOSS": ("z_loss_scale",),
              "HAS_LSE_GRAD": ("lse_grad_ptr",), "HAS_ENTROPY_GRAD": ("entropy_grad_ptr",),
              "HAS_CLASS_WEIGHT": ("class_weight_ptr", "smooth_grad_ptr")}
ALWAYS = {"hidden_ptr", "weight_ptr", "targets_ptr", "tile_max_ptr", "tile_sum_exp_ptr", "lse_ptr", "loss_grad_ptr",
          "inv_vocab_size", *INTEGERS}


def compile_logit_kernel(mode: int, flags: dict, use_tma: bool = True, persistent: bool = True):
    """The compiled logit kernel for sm_90 in ``mode`` (statistics: 0, 1, 3; gradient: 2) with the
    ``flags`` (names of STATS_FLAGS / GRAD_FLAGS, default off but PICK_TARGET, and EVEN_V, EVEN_K)."""
    kernel = _tile_kernels._tile_grad_kernel if mode == 2 else _tile_kernels._tile_stats_kernel
    flag_args = GRAD_FLAGS if mode == 2 else STATS_FLAGS
    flags = {"PICK_TARGET": mode in (0, 1), **flags}
    present = set(ALWAYS)
    for flag, on in flags.items():
        if on and flag in flag_args:
            present.update(flag_args[flag])
    if mode != 0:
        present.add("out_ptr")
    if mode == 3:
        present.update(("row_ref_ptr", "loss_grad_ptr"))
    signature, constants = {}, {}  # (descriptors for the inputs with the copy engine: USE_TMA, TMA_STORE)
    for name in inspect.signature(kernel.fn).parameters:
        if name[0].isupper():
            signature[name] = "constexpr"
        elif name not in present:
            signature[name], constants[name] = "constexpr", None
        elif name in INPUTS and use_tma:
            signature[name] = f"tensordesc<bf16{INPUTS[name]}>"
        elif name.endswith("_ptr"):
            signature[name] = POINTERS.get(name, "*bf16" if name in INPUTS or name == "bias_ptr" else "*fp32")
        elif name in INTEGERS:
            signature[name] = "i32"
        else:
            signature[name] = "fp32"
    constants.update(EVEN_K=flags.get("EVEN_K", True),
                     EVEN_V=flags.get("EVEN_V", True), INPUT_PRECISION="ieee", PERSISTENT=persistent,
                     BLOCK_N=BLOCK_N, BLOCK_V=BLOCK_V, BLOCK_K=BLOCK_K)
    source = ASTSource(kernel, signature, constants)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=8, num_stages=3))


# Pointer dtypes of the per-row kernels' arguments other than fp32.
ROW_POINTERS = {"targets_ptr": "*i64", "rows_ptr": "*i64", "tile_argmax_ptr": "*i32", "row_argmax_ptr": "*i64",
                "correct_ptr": "*i32", "buffer_ptr": "*bf16", "hidden_ptr": "*bf16", "scaled_hidden_ptr": "*bf16",
                "weight_ptr": "*bf16", "dst_rows_ptr": "*i64", "dst_ptr": "*bf16", "acc_ptr": "*bf16",
                "perm_ptr": "*i64", "hidden_rows_ptr": "*i64",
                "counts_ptr": "*i32", "flags_ptr": "*i8", "flag_ptr": "*i32", "sorted_keys_ptr": "*i16",
                "keys_ptr": "*i16"}
ROW_FLOATS = ("logit_scale", "softcap", "inv_vocab_size", "label_smoothing", "z_loss_scale")
ROW_KERNELS = {  # kernel name: its constexprs other than flags (all flags are compiled off and on)
    "_combine_tiles_kernel": dict(BLOCK_R=16, BLOCK_T=128, ACC_DTYPE=tl.float32),
    "_finalize_rows_kernel": dict(BLOCK_R=128),
    "_row_factors_kernel": dict(BLOCK_R=16, BLOCK_V=BLOCK_V),
    "_factored_rows_kernel": dict(BLOCK_R=2, BLOCK_T=128, BLOCK_V=BLOCK_V, BLOCK_H=1024),
    "_picked_logit_dot_kernel": dict(BLOCK_R=64, BLOCK_K=BLOCK_K, INPUT_PRECISION="ieee"),
    "_scale_rows_kernel": dict(BLOCK_R=16, BLOCK_C=256),
    "_target_segments_kernel": dict(BLOCK_P=4, BLOCK_H=1024),
    "_target_keys_kernel": dict(BLOCK=1024),
    "_count_targets_kernel": dict(BLOCK=1024),
    "_take_out_flags_kernel": dict(BLOCK=1024),
    "_targets_out_of_range_kernel": dict(BLOCK=1024),
    "_order_rows_kernel": dict(BLOCK=4096),
    "_zero_rows_kernel": dict(BLOCK_R=16, BLOCK_C=256),
}
# Each per-row kernel's arguments that its launches may leave None (absent inputs, metrics not
# asked for): None with flags off, given with flags on.
ROW_OPTIONAL = {
    "_combine_tiles_kernel": ("tile_entropy_ptr", "tile_argmax_ptr", "tile_logit_sum_ptr", "row_entropy_ptr",
                              "row_argmax_ptr", "row_logit_sum_ptr", "row_ref_ptr", "tile_sum_sq_ptr",
                              "row_sum_sq_ptr"),
    "_finalize_rows_kernel": ("row_entropy_ptr", "row_argmax_ptr", "row_logit_sum_ptr", "correct_ptr", "entropy_ptr",
                              "label_smoothing", "z_loss_scale"),
    "_factored_rows_kernel": ("tile_entropy_ptr", "tile_argmax_ptr", "row_entropy_ptr", "row_argmax_ptr",
                              "correct_ptr", "entropy_ptr", "scaled_hidden_ptr"),
    "_picked_logit_dot_kernel": ("bias_ptr", "rows_ptr", "softcap"),
    "_scale_rows_kernel": ("dst_rows_ptr", "target_grad_ptr", "targets_ptr", "weight_ptr"),
    "_target_segments_kernel": ("hidden_rows_ptr",),
}
ROW_WARPS = {"_order_rows_kernel": 8}  # launches other than the default 4 warps
ROW_STAGES = {"_picked_logit_dot_kernel": 6}  # launches other than the default 3 stages
# What a launch on contiguous tensors of the main heads specializes: unit column strides become
# the constant 1, and pointers, row strides and sizes divisible by 16 get that hint, without
# which a compile has no vector loads and no cp.async pipelining.
UNIT_STRIDES = ("stride_hk", "stride_wk", "stride_src_col")
DIVISIBLE = ("hidden_size", "vocab_size", "n_cols")


def compile_row_kernel(name: str, flags_on: bool):
    """A per-row kernel compiled for sm_90 as its launches on contiguous main-head tensors
    compile it, its boolean constexprs all ``flags_on`` and its optional arguments (ROW_OPTIONAL)
    given (``flags_on``) or None."""
    fn = next(getattr(module, name) for module in KERNEL_MODULES if hasattr(module, name))
    signature, constants, hints = {}, dict(ROW_KERNELS[name]), {}
    for index, (param_name, param) in enumerate(inspect.signature(fn.fn).parameters.items()):
        if not flags_on and param_name in ROW_OPTIONAL.get(name, ()):
            signature[param_name], constants[param_name] = "constexpr", None
        elif param_name.endswith("_ptr"):
            signature[param_name] = ROW_POINTERS.get(param_name, "*fp32")
            hints[(index,)] = [["tt.divisibility", 16]]
        elif param_name in constants or param.annotation is tl.constexpr or param_name.isupper():
            signature[param_name] = "constexpr"
            constants.setdefault(param_name, flags_on)
        elif param_name in UNIT_STRIDES:
            signature[param_name] = "constexpr"
            constants[param_name] = 1
        else:
            signature[param_name] = "fp32" if param_name in ROW_FLOATS else "i32"
            if param_name.startswith("stride") or param_name in DIVISIBLE:
                hints[(index,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(fn, signature, constants, hints), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=ROW_WARPS.get(name, 4), num_stages=ROW_STAGES.get(name, 3)))


def spill_bytes(kernel) -> int:
    """The bytes a compiled kernel's PTX spills to local memory (stores), from ``ptxas -v``."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
        ptx.write(kernel.asm["ptx"])
        ptx.flush()
        run = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name", "sm_90a", ptx.name, "-o", "/dev/null"],
                             capture_output=True, text=True, check=True)
    return sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", run.stderr))


def compile_gluon_stats(dtype_name: str, even_v: bool, store_exp: bool):
    """``_gluon_stats.tile_stats_kernel`` (the statistics in Gluon; with ``store_exp`` the training
    sweep's stored exponentials too) compiled for sm_90."""
    from fused_linear_ce import _gluon_stats as G
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    dtype = {"bf16": gl.bfloat16, "fp16": gl.float16}[dtype_name]
    blocks = {"h_desc": [G.ROWS_PER_GROUP.value, G.BLOCK_K.value], "w_desc": [G.BLOCK_V.value, G.BLOCK_K.value],
              "buffer_desc": [G.ROWS_PER_GROUP.value, G.HALF_V.value] if store_exp else None}
    blocks["buffer_desc"] = blocks["buffer_desc"] or blocks["h_desc"]  # not read without store_exp
    signature = {name: f"tensordesc<{dtype_name}{block},{gl.NVMMASharedLayout.get_default_for(block, dtype)!r}>"
                 for name, block in blocks.items()}
    signature.update({"tile_max_ptr": "*fp32", "tile_sum_ptr": "*fp32", "row_ref_ptr": "*fp32",
                      "loss_grad_ptr": "*fp32", "n_rows": "i32", "vocab_size": "i32", "hidden_size": "i32",
                      "group_blocks": "i32", "EVEN_V": "constexpr", "STORE_EXP": "constexpr"})
    source = GluonASTSource(G.tile_stats_kernel, signature, {"EVEN_V": even_v, "STORE_EXP": store_exp})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default="0,1,2,3")
    parser.add_argument("--flags", default="", help="constexpr overrides, e.g. RETURN_METRICS=1,HAS_BIAS=1")
    parser.add_argument("--row-kernels", action="store_true")
    parser.add_argument("--gluon", action="store_true", help="also _gluon_stats' kernel, bf16 and fp16, EVEN_V 0/1")
    args = parser.parse_args()
    flags = {k: bool(int(v)) for k, v in (kv.split("=") for kv in args.flags.split(",") if kv)}
    failed = 0
    for mode in (int(m) for m in args.modes.split(",")):
        try:
            kernel = compile_logit_kernel(mode, flags)
            print(f"mode {mode} {args.flags}: ok {kernel.metadata.shared}")
        except Exception as e:  # a compile error is the result to report
            failed += 1
            print(f"mode {mode} {args.flags}: {type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}")
    for name in ROW_KERNELS if args.row_kernels else ():
        for flags_on in (False, True):
            try:
                kernel = compile_row_kernel(name, flags_on)
                tensor_cores = " wgmma" if "wgmma" in kernel.asm["ptx"] else ""
                print(f"{name} flags={int(flags_on)}: ok {kernel.metadata.shared}{tensor_cores}"
                      f" spills={spill_bytes(kernel)}")
            except Exception as e:
                failed += 1
                print(f"{name} flags={int(flags_on)}: {type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}")
    gluon_cases = [(d, e, x) for d in ("bf16", "fp16") for e in (True, False) for x in (False, True)]
    for dtype_name, even_v, store_exp in gluon_cases if args.gluon else ():
        name = f"_gluon_stats {dtype_name} EVEN_V={int(even_v)} STORE_EXP={int(store_exp)}"
        try:
            kernel = compile_gluon_stats(dtype_name, even_v, store_exp)
            ptx = kernel.asm["ptx"]
            print(f"{name}: ok {kernel.metadata.shared} spills={spill_bytes(kernel)}"
                  f" wgmma.m64n256k16={ptx.count('wgmma.mma_async.sync.aligned.m64n256k16')}"
                  f" setmaxnreg={'setmaxnreg' in ptx}")
        except Exception as e:
            failed += 1
            print(f"{name}: {type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
