"""Compiles the logit kernel for Hopper (sm_90) without a GPU: every mode, persistent, with the
copy engine (TMA), through Triton's own compiler, so that a kernel the interpreter runs but the
GPU compiler refuses (an MLIR pass failure, a static assertion) shows up on any machine.

    TRITON_INTERPRET=0 python scripts/compile_sm90.py [--modes 0,1,2,3] [--flags HAS_BIAS=1,...]

Prints one line per variant: "ok <shared memory bytes>" or the error; exits 1 on any error.
"""

import argparse
import inspect
import sys
from pathlib import Path

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "torch-ext"))
from fused_linear_ce import _kernels as K  # noqa: E402

BLOCK_N, BLOCK_V, BLOCK_K = 128, 256, 64  # the autotuner's main configuration for bf16
POINTERS = {"targets_ptr": "*i64", "tile_argmax_ptr": "*i32"}  # others: fp32, or bf16 for the inputs
INPUTS = {"hidden_ptr": [BLOCK_N, BLOCK_K], "weight_ptr": [BLOCK_V, BLOCK_K], "out_ptr": [BLOCK_N, BLOCK_V]}
INTEGERS = ("n_rows", "vocab_size", "hidden_size", "stride_hn", "stride_hk", "stride_wv", "stride_wk", "stride_out_n")
FLOATS = ("logit_scale", "softcap", "label_smoothing", "z_loss_scale", "inv_vocab_size")


def compile_logit_kernel(mode: int, flags: dict, use_tma: bool = True, persistent: bool = True):
    """The compiled logit kernel for sm_90 in ``mode`` with the constexpr ``flags``."""
    store = use_tma and mode != int(K.MODE_STATS)
    signature, constants = {}, {}
    for name in inspect.signature(K._logit_tile_kernel.fn).parameters:
        if name in INPUTS and use_tma and (name != "out_ptr" or store):
            signature[name] = f"tensordesc<bf16{INPUTS[name]}>"
        elif name.endswith("_ptr"):
            signature[name] = POINTERS.get(name, "*bf16" if name in INPUTS or name == "bias_ptr" else "*fp32")
        elif name in INTEGERS:
            signature[name] = "i32"
        elif name in FLOATS:
            signature[name] = "fp32"
        else:
            signature[name] = "constexpr"
    constants.update(MODE=mode, HAS_BIAS=False, HAS_SOFTCAP=False, HAS_SMOOTHING=False, HAS_Z_LOSS=False,
                     HAS_LSE_GRAD=False, RETURN_METRICS=False, USE_TMA=use_tma, TMA_STORE=store, EVEN_K=True,
                     INPUT_PRECISION="ieee", PERSISTENT=persistent, BLOCK_N=BLOCK_N, BLOCK_V=BLOCK_V,
                     BLOCK_K=BLOCK_K, HAS_CLASS_WEIGHT=False, ACC_DTYPE=tl.float32, HAS_LOGIT_SCALE=False,
                     EVEN_V=True)
    constants.update(flags)
    source = ASTSource(K._logit_tile_kernel, signature, constants)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=8, num_stages=3))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default="0,1,2,3")
    parser.add_argument("--flags", default="", help="constexpr overrides, e.g. RETURN_METRICS=1,HAS_BIAS=1")
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
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
