"""Prompt rows at full kernel speed, verify rows invariant: dflash's libllama runs batches of 64 rows or more through
ggml's fast kernels (tinyBLAS for F16, the tiled matmul for K-quants) for all rows but the last, and smaller batches
and every batch's last row in the one-token order (tools/patch_ggml_cpu.py). Each test fails on a library where a
verify-sized batch, or a prompt batch's last row, takes the fast kernels."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("llama_cpp")
pytest.importorskip("gguf")

from dflash_local.decode import Settings, run  # noqa: E402
from dflash_local.gguf.convert import convert  # noqa: E402
from dflash_local.llama_lib import loaded_library, splits_prompt_rows  # noqa: E402
from dflash_local.runtime import LoadSpec, RuntimeConfig  # noqa: E402
from dflash_local.targets.llamacpp import BATCH, VERIFY_ROWS, LlamaCppTarget, model_params  # noqa: E402
from dflash_local.tokenizer import TextTokenizer  # noqa: E402

TINY = Path(__file__).resolve().parent.parent / "models" / "tiny"
NEW_TOKENS = 64
PROMPT_LENGTHS = (200, BATCH + 88)  # one prompt batch; two (the second of 88 rows)


@pytest.fixture(scope="module")
def fast_types(tiny_gguf, tmp_path_factory) -> dict[str, Path]:
    """The bundled target as F16 (tinyBLAS's type; conftest's) and Q4_K_M (the tiled matmul's)."""
    q4_k_m = convert(TINY / "target", tmp_path_factory.mktemp("prompt-rows") / "tiny-q4_k_m.gguf", "q4_k_m", threads=1)
    return {"f16": tiny_gguf["f16"], "q4_k_m": q4_k_m}


@pytest.fixture(scope="module")
def long_prompts() -> list[list[int]]:
    """Held-out prompts joined and cut to PROMPT_LENGTHS tokens."""
    lines = (TINY / "heldout_prompts.jsonl").read_text().splitlines()
    ids = TextTokenizer.load(TINY / "target").encode(" ".join(json.loads(line)["prompt"] for line in lines))
    assert len(ids) >= max(PROMPT_LENGTHS)
    return [ids[:length] for length in PROMPT_LENGTHS]


def load(path: Path) -> LlamaCppTarget:
    return LlamaCppTarget.load(path, LoadSpec(RuntimeConfig(threads=1), max_context=1024))


def test_the_loaded_libllama_keeps_verify_rows_apart_from_prompt_rows():
    """The suite runs on dflash's patched build (install.sh builds it), else the tests below prove nothing new."""
    assert splits_prompt_rows(loaded_library().parent), loaded_library()


@pytest.mark.parametrize("kind", ["f16", "q4_k_m"])
def test_the_widest_verify_after_a_long_prompt_has_the_logits_of_one_token_decodes(kind, fast_types):
    """After a 200-token prompt (fast kernels), a forward of VERIFY_ROWS (63) rows, the widest one decode the target
    runs for a verify, equals 63 one-token forwards in every bit."""
    target = load(fast_types[kind])
    ids = torch.randint(5, target.vocab_size, (200 + VERIFY_ROWS,), generator=torch.Generator().manual_seed(1))
    target.forward(ids[:200], all_logits=False, features=False)
    together = target.forward(ids[200:], features=False).logits
    target.trim(200)
    alone = torch.cat([target.forward(ids[i : i + 1], features=False).logits for i in range(200, len(ids))])
    differ = (together != alone).any(dim=1).nonzero().flatten().tolist()
    assert differ == [], f"{kind}: rows {differ} of {VERIFY_ROWS} differ (libllama: {loaded_library()})"


@pytest.mark.parametrize("kind", ["f16", "q4_k_m"])
def test_a_prompts_logits_do_not_depend_on_which_rows_are_outputs(kind, fast_types, long_prompts):
    """A drafter reading the last layer (MTP's) makes every prompt row an output, so llama.cpp runs the last layer's
    feed-forward and the head on the whole batch, where plain decoding runs them on the last row alone: the prompt's
    last logits are the same bits both ways, for one prompt batch and for two."""
    target = load(fast_types[kind])
    for prompt in long_prompts:
        ids = torch.tensor(prompt)
        target.trim(0)
        plain = target.forward(ids, all_logits=False, features=False).logits
        target.trim(0)
        target.set_feature_layers([target.num_layers - 1])
        every_row = target.forward(ids, all_logits=False, features=True)
        target.set_feature_layers([])
        assert every_row.features.shape[0] == len(prompt)
        assert torch.equal(every_row.logits, plain), (kind, len(prompt))


def llamacpp_greedy(path: Path, prompt: list[int], monkeypatch) -> list[int]:
    """llama.cpp's own greedy run (Llama.generate, top_k=1) under the target's model options: the prompt in batches
    of BATCH rows, then one llama_decode per token."""
    from llama_cpp import Llama, llama_cpp

    monkeypatch.setattr(llama_cpp, "llama_model_default_params", lambda: model_params().params)
    own = Llama(str(path), n_ctx=1024, n_batch=BATCH, n_threads=1, n_threads_batch=1, flash_attn=True, verbose=False)
    sizes: list[int] = []
    decode = own._ctx.decode
    monkeypatch.setattr(own._ctx, "decode", lambda batch: sizes.append(batch.n_tokens()) or decode(batch))
    stream = own.generate(prompt, top_k=1, temp=0.0, reset=True)
    out = [next(stream) for _ in range(NEW_TOKENS)]
    batches = [BATCH] * (len(prompt) // BATCH) + [len(prompt) % BATCH]
    assert sizes == batches + [1] * (NEW_TOKENS - 1)
    return out


@pytest.mark.parametrize("kind", ["f16", "q4_k_m"])
def test_dflash_after_long_prompts_equals_llamacpp_greedy(kind, fast_types, long_prompts, drafter, monkeypatch):
    """Prompts of 200 and 600 tokens (their batches through the fast kernels), blocks 4 and 16: DFlash gives the ids of
    llama.cpp's own greedy run of the same prompt in the same batches."""
    target = load(fast_types[kind])
    for prompt in long_prompts:
        expected = llamacpp_greedy(fast_types[kind], prompt, monkeypatch)
        for block in (4, 16):
            ids, _ = run(target, drafter, prompt, Settings(max_new_tokens=NEW_TOKENS, block_size=block))
            assert ids == expected, (kind, len(prompt), block)
