"""Compile every Triton kernel for a CUDA architecture without a GPU; prints {kernel: cubin bytes} as JSON.

python tests/compile_kernels.py [SM]   (default 86: RTX 30xx). Run without TRITON_INTERPRET.
"""

from __future__ import annotations

import inspect
import json
import sys

import triton
from dflash_local.kernels.accept_triton import _greedy_accept_kernel
from dflash_local.kernels.attention_triton import _block_attention_kernel
from dflash_local.kernels.rmsnorm_triton import _rms_norm_kernel
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def build(fn, types: dict[str, str], constants: dict, sm: int) -> int:
    """Size of the cubin for fn specialized to the argument types and constants."""
    names = list(inspect.signature(fn.fn).parameters)
    signature = {name: "constexpr" if name in constants else types[name] for name in names}
    kernel = triton.compile(ASTSource(fn, signature, constants), target=GPUTarget("cuda", sm, 32))
    return len(kernel.asm["cubin"])


def pointers(dtype: str, *names: str) -> dict[str, str]:
    return {name: f"*{dtype}" for name in names}


def compile_all(sm: int) -> dict[str, int]:
    """The GPU path's kernel variants (Llama-8B drafter shapes) in bf16 and fp32."""
    results = {}
    for dtype in ("bf16", "fp32"):
        norm = pointers(dtype, "x_ptr", "res_ptr", "w_ptr", "out_ptr", "sum_ptr")
        norm |= {"num_rows": "i32", "width": "i32", "eps": "fp32"}
        fused = {"HAS_RESIDUAL": True, "ROWS": 1, "BLOCK": 4096}
        results[f"rmsnorm+residual {dtype}"] = build(_rms_norm_kernel, norm, fused, sm)
        heads = {"HAS_RESIDUAL": False, "ROWS": 32, "BLOCK": 128}
        results[f"rmsnorm heads {dtype}"] = build(_rms_norm_kernel, norm, heads, sm)
        for in_memory in (False, True):
            attention = pointers(dtype, "q_ptr", "pk_ptr", "pv_ptr", "k_ptr", "v_ptr", "o_ptr")
            for tensor in ("sq", "pk", "pv", "k", "v", "o"):
                for dim in ("b", "h", "m" if tensor in ("sq", "o") else "n"):
                    attention[f"{tensor}_{dim}"] = "i32"
            attention |= {"num_kv_heads": "i32", "context": "i32", "scale": "fp32"}
            attention["context_ptr"] = "*i64" if in_memory else f"*{dtype}"
            constants = dict(BLOCK=16, GROUP=4, HEAD_DIM=128, ROWS=64, TILE=64, BLOCK_KEYS=16, DIM=128)
            constants |= dict(CONTEXT_IN_MEMORY=in_memory, CAUSAL=in_memory, WINDOW=0 if in_memory else 512)
            constants["PRECISION"] = "ieee" if dtype == "fp32" else "tf32"
            results[f"attention {dtype} context_in_memory={in_memory}"] = build(
                _block_attention_kernel, attention, constants, sm
            )
    accept = {"logits_ptr": "*fp32", "row_stride": "i32", "draft_ptr": "*i64", "out_ptr": "*i64"}
    accept |= {"vocab": "i32", "num_draft": "i32"}
    results["greedy accept"] = build(_greedy_accept_kernel, accept, {"TILE": 1024}, sm)
    return results


if __name__ == "__main__":
    json.dump(compile_all(int(sys.argv[1]) if len(sys.argv) > 1 else 86), sys.stdout)
