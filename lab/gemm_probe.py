"""grad_weight's accumulating product alone: cuBLAS against a Triton product, on the GPU.

A training step adds each chunk's E'^T (diag(r) H) to grad_weight, ``C += A^T B`` with A the
chunk's buffer [K rows, V], B its scaled hidden rows [K, H] and C grad_weight [V, H] in 16 bits.
cuBLAS's beta = 1 kernels read C in their epilogue, after the main loop; this probe times them
against their beta = 0 kernels (the rate without the read), against the transposed formulation
(C^T += B^T A, the same bytes) and against a persistent TMA Triton product that loads C before or
after its main loop, in ms and TFLOP/s (do_bench medians) and joules a call (NVML, back to back).

    python lab/gemm_probe.py --out probe.json [--heads llama2,llama3] [--rows 1536]
"""

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.testing import do_bench
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench import GpuSampler, energy_counter, environment  # noqa: E402

HEADS = {"llama2": (4096, 32000), "llama3": (4096, 128256), "qwen25": (3584, 152064), "gemma2": (2304, 256000)}


@triton.jit
def _accumulate_kernel(a_desc, b_desc, c_desc, c_ptr, M, N, K, stride_cm, NUM_PROGRAMS: tl.constexpr,
                       C_EARLY: tl.constexpr, C_TMA: tl.constexpr, STORE_TMA: tl.constexpr, WS: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """C[M, N] += A[K, M]^T @ B[K, N], fp32 sums, one rounding to C's dtype; persistent over tiles
    with N fastest (a program's next tile reuses A's strip from L2). C is read through TMA
    (C_TMA, shared memory) or by pointers (registers), before the main loop (C_EARLY) or after,
    and written through TMA (STORE_TMA) or by pointers."""
    num_n = tl.cdiv(N, BLOCK_N)
    num_tiles = tl.cdiv(M, BLOCK_M) * num_n
    for tile in tl.range(tl.program_id(0), num_tiles, NUM_PROGRAMS, flatten=not WS, warp_specialize=WS):
        off_m = (tile // num_n) * BLOCK_M
        off_n = (tile % num_n) * BLOCK_N
        offs_m = (off_m + tl.arange(0, BLOCK_M)).to(tl.int64)
        offs_n = off_n + tl.arange(0, BLOCK_N)
        c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :]
        c_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        if C_EARLY:
            if C_TMA:
                c = c_desc.load([off_m, off_n])
            else:
                c = tl.load(c_ptrs, mask=c_mask, other=0.0)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            a = a_desc.load([k * BLOCK_K, off_m])  # [BLOCK_K, BLOCK_M]
            b = b_desc.load([k * BLOCK_K, off_n])  # [BLOCK_K, BLOCK_N]
            acc = tl.dot(a.T, b, acc)
        if not C_EARLY:
            if C_TMA:
                c = c_desc.load([off_m, off_n])
            else:
                c = tl.load(c_ptrs, mask=c_mask, other=0.0)
        acc += c.to(tl.float32)
        if STORE_TMA:
            c_desc.store([off_m, off_n], acc.to(c_desc.dtype))
        else:
            tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


def triton_accumulate(c, a, b, block_m, block_n, block_k, stages, warps, c_early, c_tma, store_tma=True):
    k_rows, m = a.shape
    n = b.shape[1]
    programs = torch.cuda.get_device_properties(c.device).multi_processor_count
    a_desc = TensorDescriptor.from_tensor(a, [block_k, block_m])
    b_desc = TensorDescriptor.from_tensor(b, [block_k, block_n])
    c_desc = TensorDescriptor.from_tensor(c, [block_m, block_n])
    _accumulate_kernel[(programs,)](a_desc, b_desc, c_desc, c, m, n, k_rows, c.stride(0), NUM_PROGRAMS=programs,
                                    C_EARLY=c_early, C_TMA=c_tma, STORE_TMA=store_tma, WS=False, BLOCK_M=block_m,
                                    BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages)


TRITON_CONFIGS = [  # (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps, C_EARLY, C_TMA, STORE_TMA)
    (128, 256, 64, 3, 8, False, False, False), (128, 256, 32, 4, 8, False, True, True),
]


def make_variants(a, b, c) -> dict:
    """Name: a call that adds A^T B to C (or, beta = 0, writes it)."""
    variants = {
        "cublas beta=1": lambda: c.addmm_(a.t(), b),
        "cublas beta=0": lambda: torch.mm(a.t(), b, out=c),
        "cublas beta=1 transposed": lambda: c.t().addmm_(b.t(), a),
        "cublas beta=0 transposed": lambda: torch.mm(b.t(), a, out=c.t()),
        "cublasLt beta=1": lambda: lt(lambda: c.addmm_(a.t(), b)),
        "cublasLt beta=1 transposed": lambda: lt(lambda: c.t().addmm_(b.t(), a)),
        "cublas beta=1 fp32 reductions": lambda: fp32_reductions(lambda: c.addmm_(a.t(), b)),
    }
    for cfg in TRITON_CONFIGS:
        flags = (" early" if cfg[5] else "") + (" tma-load" if cfg[6] else "") + (" tma-store" if cfg[7] else "")
        name = "triton {}x{}x{} s{} w{}".format(*cfg[:5]) + flags
        variants[name] = lambda cfg=cfg: triton_accumulate(c, a, b, *cfg)
    return variants


def lt(fn):
    """``fn()`` with cuBLASLt as torch's preferred BLAS library."""
    previous = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    try:
        return fn()
    finally:
        torch.backends.cuda.preferred_blas_library(previous)


def fp32_reductions(fn):
    """``fn()`` with cuBLAS's reduced-precision bf16 reductions off (torch's flag, on by default):
    whether its beta = 1 epilogue then rounds A^T B + C once, as the Triton product does, rather
    than twice (run 57's probe: a maximum error of one bf16 step where the Triton product's is
    half of one). Run 58: it does not; the error and the time are the flag's default's."""
    flags = torch.backends.cuda.matmul
    previous = flags.allow_bf16_reduced_precision_reduction
    flags.allow_bf16_reduced_precision_reduction = False
    try:
        return fn()
    finally:
        flags.allow_bf16_reduced_precision_reduction = previous


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--heads", default="llama2,llama3")
    parser.add_argument("--rows", type=int, default=1536)
    parser.add_argument("--rep-ms", type=int, default=300)
    args = parser.parse_args()
    result = {"environment": environment(), "results": []}
    for head in args.heads.split(","):
        h, v = HEADS[head]
        gen = torch.Generator(device="cuda").manual_seed(0)
        a = (torch.rand(args.rows, v, device="cuda", generator=gen) ** 8).to(torch.bfloat16)  # E' in [0, 1]
        b = torch.randn(args.rows, h, device="cuda", generator=gen).to(torch.bfloat16) * 0.01
        c0 = torch.randn(v, h, device="cuda", generator=gen).to(torch.bfloat16) * 0.01
        expected = (c0.float() + a.float().t() @ b.float())
        flops = 2 * args.rows * v * h
        c = c0.clone()
        variants = make_variants(a, b, c)
        for name, fn in variants.items():
            entry = {"head": head, "rows": args.rows, "variant": name}
            try:
                c.copy_(c0)
                fn()
                torch.cuda.synchronize()
                if "beta=0" not in name:
                    entry["max_abs_err"] = (c.float() - expected).abs().max().item()
                entry["ms"] = do_bench(fn, warmup=200, rep=args.rep_ms, return_mode="median")
                entry["tflops"] = flops / entry["ms"] / 1e9
                entry.update(sustained(fn, args.rep_ms))
                entry["sustained_tflops"] = flops / entry["sustained_ms"] / 1e9
                entry["kernels"] = kernel_names(fn)
            except Exception as exc:  # a configuration that does not compile or fit
                entry["error"] = f"{type(exc).__name__}: {exc}"[:300]
            print(json.dumps(entry), flush=True)
            result["results"].append(entry)
            Path(args.out).write_text(json.dumps(result, indent=1))


def sustained(fn, rep_ms):
    """Back-to-back calls for about ``rep_ms`` (no cache flush between them, as in a step): ms and
    joules a call, and the clock and power meanwhile."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    start.record()
    for _ in range(5):
        fn()
    end.record()
    torch.cuda.synchronize()
    calls = max(10, int(rep_ms / (start.elapsed_time(end) / 5)))
    read = energy_counter()
    with GpuSampler() as sampler:
        torch.cuda.synchronize()
        joules = read() if read else None
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        joules = (read() - joules) / calls if read else None
    return {"sustained_ms": start.elapsed_time(end) / calls, "joules": joules, "gpu": sampler.summary()}


def kernel_names(fn) -> list[str]:
    """The kernels one call launches (the profiler's names)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sorted({e.name[:80] for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})

if __name__ == "__main__":
    main()
