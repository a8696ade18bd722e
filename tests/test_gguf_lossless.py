"""Lossless on every GGUF quantization: DFlash's batched verification reproduces llama.cpp's one-token greedy run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("llama_cpp")
pytest.importorskip("gguf")

from dflash_local.block_policy import AcceptanceEstimate, BlockPolicy, CostTable  # noqa: E402
from dflash_local.decode import Settings, run  # noqa: E402
from dflash_local.drafters.native import NativeDrafter  # noqa: E402
from dflash_local.gguf.convert import convert  # noqa: E402
from dflash_local.llama_lib import loaded_library  # noqa: E402
from dflash_local.runtime import LoadSpec, RuntimeConfig
from dflash_local.targets.llamacpp import LlamaCppTarget, model_params  # noqa: E402

TINY = Path(__file__).resolve().parent.parent / "models" / "tiny"
NEW_TOKENS = 128
K_QUANTS = ("q4_k_m", "q5_k_m", "q6_k")


@pytest.fixture(scope="session")
def gguf_types(tiny_gguf, tmp_path_factory) -> dict[str, Path]:
    """The bundled target as F16 and Q8_0 (conftest's tiny_gguf) and, converted once here, Q4_K_M, Q5_K_M, Q6_K."""
    root = tmp_path_factory.mktemp("gguf-types")
    made = {kind: convert(TINY / "target", root / f"tiny-{kind}.gguf", kind, threads=1) for kind in K_QUANTS}
    return {**tiny_gguf, **made}


def llamacpp_greedy(
    path: Path, prompts: list[list[int]], monkeypatch, new_tokens: int = NEW_TOKENS, **context: int
) -> list[list[int]]:
    """llama.cpp's own greedy run (Llama.generate, top_k=1) under the target's model options and `context`'s
    further Llama arguments (type_k, type_v); checks that every token after the prompt went through llama_decode
    alone."""
    from llama_cpp import Llama, llama_cpp

    monkeypatch.setattr(llama_cpp, "llama_model_default_params", lambda: model_params().params)
    own = Llama(str(path), n_ctx=512, n_threads=1, n_threads_batch=1, flash_attn=True, verbose=False, **context)
    sizes: list[int] = []
    decode = own._ctx.decode
    monkeypatch.setattr(own._ctx, "decode", lambda batch: sizes.append(batch.n_tokens()) or decode(batch))
    out = []
    for prompt in prompts:
        own.reset()  # else generate reuses a prefix shared with the last prompt
        sizes.clear()
        stream = own.generate(prompt, top_k=1, temp=0.0, reset=True)
        out.append([next(stream) for _ in range(new_tokens)])
        assert sizes == [len(prompt)] + [1] * (new_tokens - 1)
    return out


def auto_policy(block: int) -> BlockPolicy:
    """--block-size auto's policy with scripted costs that stay (timed steps do not move them), which make plain,
    short and full blocks all worth choosing."""
    steps = {k: 1.0 + 0.3 * (k - 1) for k in range(1, block + 1)}
    costs = CostTable(steps, dict.fromkeys(range(2, block + 1), 0.2))
    costs.observe = lambda *args, **kwargs: None
    return BlockPolicy(block, costs, AcceptanceEstimate.empty(block - 1, 0.999))


@pytest.mark.parametrize("kind", ["f16", "q8_0", *K_QUANTS])
def test_dflash_equals_llamacpp_one_token_greedy(kind, gguf_types, heldout, drafter, monkeypatch):
    """10 held-out prompts, 128 tokens, blocks 4, 16 and auto: the same ids as llama.cpp decoding one token per
    llama_decode. The torch and native drafters take turns by prompt (each meets every block on 5 prompts); the
    trained drafter's mean tau at block 16 is above 1.8 on every type."""
    expected = llamacpp_greedy(gguf_types[kind], heldout, monkeypatch)
    target = LlamaCppTarget.load(gguf_types[kind], LoadSpec(RuntimeConfig(threads=1), max_context=1024))
    drafters = (drafter, NativeDrafter.load(TINY / "drafter", target, LoadSpec(RuntimeConfig(threads=1))))
    taus = []
    for index, prompt in enumerate(heldout):
        for block, policy in ((4, None), (16, None), (None, auto_policy(drafter.block_size))):
            settings = Settings(max_new_tokens=NEW_TOKENS, block_size=block)
            ids, stats = run(target, drafters[index % 2], prompt, settings, policy)
            assert ids == expected[index], (kind, index, block, type(drafters[index % 2]).__name__)
            if block == 16:
                taus.append(stats.tau)
    assert sum(taus) / len(taus) > 1.8, (kind, taus)


@pytest.mark.parametrize("kind", ["f16", "q8_0", *K_QUANTS])
def test_a_verify_batch_has_the_logits_of_one_token_decodes(kind, gguf_types):
    """A 16-token forward's logits equal, in every bit, those of 16 one-token forwards after the same prefix (F16 and
    K-quants need dflash's libllama, whose batches under 64 rows keep the one-token order, and unrepacked weights)."""
    target = LlamaCppTarget.load(gguf_types[kind], LoadSpec(RuntimeConfig(threads=1), max_context=256))
    ids = torch.randint(5, target.vocab_size, (56,), generator=torch.Generator().manual_seed(0))
    target.forward(ids[:40], all_logits=False, features=False)
    together = target.forward(ids[40:], features=False).logits
    target.trim(40)
    alone = torch.cat([target.forward(ids[i : i + 1], features=False).logits for i in range(40, 56)])
    differ = (together != alone).any(dim=1).nonzero().flatten().tolist()
    assert differ == [], f"{kind}: rows {differ} of 16 differ (libllama: {loaded_library()})"


def test_convert_writes_the_new_types(gguf_types, tmp_path):
    """`dflash convert --type` q6_k, q5_k_m and q4_0: llama.cpp's quantizer writes that type (a layer's q matrix)."""
    import gguf

    q4_0 = convert(TINY / "target", tmp_path / "tiny-q4_0.gguf", "q4_0", threads=1)
    for path, want in ((gguf_types["q6_k"], "Q6_K"), (gguf_types["q5_k_m"], "Q5_K"), (q4_0, "Q4_0")):
        types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
        assert types["blk.0.attn_q.weight"] == want, path
