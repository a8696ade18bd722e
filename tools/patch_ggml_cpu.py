"""Patches the vendored ggml CPU backend before dflash builds it (tools/build_libllama.sh, every backend).

- Prompt rows: a matmul whose batch has PROMPT_ROWS rows or more (a prompt chunk) runs all rows but its last through
  ggml's fast kernels (the tiled K-quant matmul, llamafile's tinyBLAS); a smaller batch (a verify block, a one-token
  decode) and the last row of every batch sum in the one-token order. The last row is the one a prompt's logits come
  from, also when every row is an output (a drafter reading the last layer), so it equals a one-row forward's.
- Experts: MUL_MAT_ID never takes the tiled kernel (it would take a verify batch's rows routed to one expert).
- One-row attention: flash attention of a one-row batch never splits the cells among threads (ggml's split-KV path,
  taken from 512 cells on, sums in another order and precision than a verify row's kernel: logits of a one-token step
  differed from the same row's in a verify by up to 3.7 on Gemma 3 270M), so a one-token step's row equals a verify's.

    python tools/patch_ggml_cpu.py path/to/ggml/src/ggml-cpu
"""

from __future__ import annotations

import sys
from pathlib import Path

PROMPT_ROWS = 64  # ggml's own prompt/verify line: flash attention tiles queries of 64 rows or more (GGML_FA_TILE_Q)

SIGNATURE = "void ggml_compute_forward_mul_mat(\n"
ARGS = "        const struct ggml_compute_params * params,\n              struct ggml_tensor * dst"
# (old, new, count) inside ggml_compute_forward_mul_mat: it becomes ..._rows(params, dst, fast), whose fast kernels
# (the tiled call, both llamafile calls) run only where fast is set
ROWS_EDITS = (
    (SIGNATURE + ARGS + ") {", "static void ggml_compute_forward_mul_mat_rows(\n" + ARGS + ", const bool fast) {", 1),
    ("    if (ggml_compute_forward_mul_mat_tiled(", "    if (fast && ggml_compute_forward_mul_mat_tiled(", 1),
    ("                if (!llamafile_sgemm(", "                if (!fast || !llamafile_sgemm(", 2),
)
EXPERT_TILED = "        if (ggml_compute_forward_mul_mat_id_tiled("
SPLIT_KV = "q->type == GGML_TYPE_F32 && nek1 >= 512;"  # the end of ops.cpp's use_split_kv_path
SPLIT = f"""
// dflash (tools/patch_ggml_cpu.py): batches of DFLASH_PROMPT_ROWS rows or more take the fast kernels for all rows but
// the last; smaller batches and every batch's last row sum in the one-token order.
#define DFLASH_PROMPT_ROWS {PROMPT_ROWS}

void ggml_compute_forward_mul_mat(
        const struct ggml_compute_params * params,
              struct ggml_tensor * dst) {{
    const struct ggml_tensor * src1 = dst->src[1];
    const int64_t rows = src1->ne[1];
    if (rows < DFLASH_PROMPT_ROWS || ggml_get_op_params_i32(dst, 1) == GGML_HINT_SRC0_IS_HADAMARD) {{
        ggml_compute_forward_mul_mat_rows(params, dst, false);
        return;
    }}
    struct ggml_tensor head_src1 = *src1, head = *dst, last_src1 = *src1, last = *dst;
    head_src1.ne[1] = head.ne[1] = rows - 1;
    head.src[1] = &head_src1;
    last_src1.ne[1] = last.ne[1] = 1;
    last_src1.data = (char *) src1->data + (rows - 1)*src1->nb[1];
    last.data = (char *) dst->data + (rows - 1)*dst->nb[1];
    last.src[1] = &last_src1;
    ggml_compute_forward_mul_mat_rows(params, &head, true);
    ggml_barrier(params->threadpool);  // the last row reuses the work buffer and the chunk counter
    ggml_compute_forward_mul_mat_rows(params, &last, false);
}}
"""


def replace(source: str, old: str, new: str, count: int = 1) -> str:
    """source with its count occurrences of old replaced by new; stops the build where the source changed."""
    if source.count(old) != count:
        raise SystemExit(f"patch_ggml_cpu.py: ggml-cpu no longer holds {old.strip()!r} {count}x; update this patch")
    return source.replace(old, new)


def split_prompt_rows(source: str) -> str:
    """ggml-cpu.c with the matmul split into prompt rows (fast kernels) and one-token-order rows, and the experts'
    tiled kernel off."""
    start = max(source.find(SIGNATURE), 0)
    end = source.find("\n}\n", start) + 3
    body = source[start:end]  # the function (where it is gone, the first edit stops the build)
    for old, new, count in ROWS_EDITS:
        body = replace(body, old, new, count)
    source = source[:start] + body + SPLIT + source[end:]
    return replace(source, EXPERT_TILED, "        if (false && ggml_compute_forward_mul_mat_id_tiled(")


def patch(ggml_cpu: Path) -> None:
    """Applies the patch in place to the ggml-cpu source folder."""
    path = ggml_cpu / "ggml-cpu.c"
    path.write_text(split_prompt_rows(path.read_text()))
    path = ggml_cpu / "ops.cpp"
    path.write_text(replace(path.read_text(), SPLIT_KV, SPLIT_KV.replace("nek1 >= 512", "false")))


if __name__ == "__main__":
    patch(Path(sys.argv[1]))
