"""--cache-type q8_0|q4_0 (llama.cpp's quantized KV caches): DFlash equals llama.cpp's own one-token greedy run with the
same cache type, on the bundled pair and on a hybrid (qwen35) target; the fit check counts the bytes llama.cpp
allocates; what llama.cpp or dflash cannot run is one sentence."""

from __future__ import annotations

import ctypes
import json
import os
import re
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from in_process import invoke
from one_error import assert_one_error
from reference import oracle_python
from test_architectures import PROMPT, ChainDrafter, llama_cpp_source
from test_gguf_lossless import TINY, auto_policy, llamacpp_greedy
from test_offload import reference_sizes
from test_sampled_lossless import llamacpp_model

from dflash_local import memory_estimate, offload
from dflash_local.decode import Settings, run
from dflash_local.drafters.native import NativeDrafter
from dflash_local.kv_cache import KVCache
from dflash_local.llama_lib import llama_cpp, quiet_llama_logs
from dflash_local.runtime import LoadSpec, RuntimeConfig
from dflash_local.targets.llamacpp import LlamaCppTarget, context_params, model_params

TESTS = Path(__file__).resolve().parent
QUANTIZED = ("q8_0", "q4_0")
NEW_TOKENS = 64


def ggml_types(kind: str) -> dict[str, int]:
    """llama-cpp-python's Llama arguments for a `kind` K and V cache."""
    value = getattr(llama_cpp, f"GGML_TYPE_{kind.upper()}")
    return {"type_k": value, "type_v": value}


@pytest.fixture(scope="module")
def archs(tmp_path_factory) -> Path:
    """tests/tiny_archs.py's qwen35 (Gated DeltaNet + attention, 16-wide heads) and qwen35-h64 (64-wide heads, which a
    quantized cache takes, rotated: see tiny_archs.py), built in one oracle process; their folder."""
    root = tmp_path_factory.mktemp("archs")
    command = [oracle_python(), TESTS / "tiny_archs.py", llama_cpp_source(), root, "qwen35", "qwen35-h64"]
    built = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert built.returncode == 0, built.stderr[-3000:]
    return root


@pytest.mark.parametrize("kind", QUANTIZED)
def test_dflash_equals_llamacpp_greedy_with_the_same_cache_type(kind, tiny_gguf, heldout, drafter, monkeypatch):
    """The bundled Q8_0 target, 4 held-out prompts, 64 tokens, blocks 4, 16 and auto, torch and native drafters by
    turns: the ids of llama.cpp decoding one token per llama_decode with the same cache type. The target's logits
    differ from the f16 cache's (its ids need not, on every CPU), so the type is applied."""
    path, prompts = tiny_gguf["q8_0"], heldout[:4]
    expected = llamacpp_greedy(path, prompts, monkeypatch, NEW_TOKENS, **ggml_types(kind))
    spec = LoadSpec(RuntimeConfig(threads=1), max_context=1024, kv_cache=KVCache(kind, kind))
    target = LlamaCppTarget.load(path, spec)
    f16 = LlamaCppTarget.load(path, replace(spec, kv_cache=KVCache()))
    logits = [model.forward(torch.tensor(prompts[0]), features=False).logits for model in (target, f16)]
    assert not torch.equal(*logits), kind
    target.trim(0)
    drafters = (drafter, NativeDrafter.load(TINY / "drafter", target, spec))
    for index, prompt in enumerate(prompts):
        for block, policy in ((4, None), (16, None), (None, auto_policy(drafter.block_size))):
            settings = Settings(max_new_tokens=NEW_TOKENS, block_size=block)
            ids, stats = run(target, drafters[index % 2], prompt, settings, policy)
            assert ids == expected[index], (kind, index, block, type(drafters[index % 2]).__name__)
            assert stats.tau > 1.2, (kind, index, block, stats.tau)  # drafts were accepted: verify batches ran


@pytest.mark.parametrize("kind", QUANTIZED)
def test_a_hybrid_target_with_a_quantized_cache_drafts_losslessly(kind, archs, monkeypatch):
    """qwen35 (recurrent state beside the quantized attention cache), a drafter often right and often rejected, blocks
    4, 16 and auto: llama.cpp's own greedy ids with the same cache type. The target's logits differ from the f16
    cache's (its ids need not: this random model's logits are far apart), so the type is applied."""
    hybrid, new_tokens = archs / "qwen35-h64" / "model.gguf", 24
    expected = llamacpp_greedy(hybrid, [PROMPT], monkeypatch, new_tokens, **ggml_types(kind))[0]
    spec = LoadSpec(RuntimeConfig(threads=1), max_context=256, kv_cache=KVCache(kind, kind))
    target, f16 = LlamaCppTarget.load(hybrid, spec), LlamaCppTarget.load(hybrid, replace(spec, kv_cache=KVCache()))
    logits = [model.forward(torch.tensor(PROMPT), features=False).logits for model in (target, f16)]
    assert not torch.equal(*logits), kind
    target.trim(0)
    drafter = ChainDrafter(llamacpp_model(hybrid), block_size=16)
    verified = []
    for block, policy in ((4, None), (16, None), (None, auto_policy(16))):
        ids, stats = run(target, drafter, PROMPT, Settings(max_new_tokens=new_tokens, block_size=block), policy)
        assert ids == expected, (kind, block)
        verified += [(n, k) for n, k in zip(stats.acceptance_lengths, stats.block_sizes, strict=True) if k > 1]
    assert any(n > 1 for n, _ in verified) and any(n < k for n, k in verified), (kind, verified)  # kept and rolled back


@pytest.mark.parametrize("kind", QUANTIZED)
def test_a_verify_batch_has_the_logits_of_one_token_decodes_at_any_length_and_thread_count(kind, tiny_gguf):
    """2 threads, a 600-token prefix (past 256 cached tokens, where an f16 cache's one-token attention splits its
    cells over the threads): a 16-token forward's logits equal 16 one-token forwards' in every bit, since ggml-cpu's
    flash attention computes every row over a quantized K alike."""
    spec = LoadSpec(RuntimeConfig(threads=2), max_context=1024, kv_cache=KVCache(kind, kind))
    target = LlamaCppTarget.load(tiny_gguf["q8_0"], spec)
    ids = torch.randint(5, target.vocab_size, (616,), generator=torch.Generator().manual_seed(0))
    target.forward(ids[:600], all_logits=False, features=False)
    together = target.forward(ids[600:], features=False).logits
    target.trim(600)
    alone = torch.cat([target.forward(ids[i : i + 1], features=False).logits for i in range(600, 616)])
    assert (together != alone).any(dim=1).nonzero().flatten().tolist() == [], kind


def llamacpp_kv_log(path: Path, spec: LoadSpec, context: int) -> dict[str, float]:
    """What llama.cpp reports allocating for the KV cache of a context made with dflash's context parameters: its
    cells, and K's and V's MiB (its log line `llama_kv_cache: size = ...`)."""
    lines: list[str] = []

    @llama_cpp.llama_log_callback
    def keep(level: int, text: bytes, user_data) -> None:
        lines.append(text.decode(errors="replace"))

    llama_cpp.llama_log_set(keep, ctypes.c_void_p(0))
    try:
        model = llama_cpp.llama_model_load_from_file(str(path).encode(), model_params(spec).params)
        ctx = llama_cpp.llama_init_from_model(model, context_params(spec, context))
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)
    finally:
        quiet_llama_logs()
    log = "".join(lines)
    found = re.search(r"\(\s*(\d+) cells.*K \((\w+)\): +([\d.]+) MiB, V \((\w+)\): +([\d.]+) MiB", log)
    assert found, log[-2000:]
    cells, k_type, k_mib, v_type, v_mib = found.groups()
    assert (k_type, v_type) == (spec.kv_cache.k, spec.kv_cache.v)
    return {"cells": int(cells), "K": float(k_mib), "V": float(v_mib)}


@pytest.mark.parametrize("cache", [KVCache(), KVCache("q8_0", "q8_0"), KVCache("q4_0", "q4_0"), KVCache("q8_0", "f16")])
def test_the_fit_check_counts_what_llamacpp_allocates(cache, tiny_gguf):
    """At a 1000-token context: the KV bytes the placement planner adds to the layers (offload) and the memory
    estimate's KV cache equal K + V as llama.cpp's log reports them for that cache type (to its 0.01 MiB)."""
    path, context = tiny_gguf["f16"], 1000
    reported = llamacpp_kv_log(path, LoadSpec(RuntimeConfig(threads=1), kv_cache=cache), context)
    assert reported["cells"] == memory_estimate.llama_context(context)
    sizes, _, _ = reference_sizes(path, cpu_moe=False)
    layers, _ = offload._per_layer(offload.read_gguf(path), False, context, cache)
    planned = sum(layers) - sum(sizes)
    assert planned == memory_estimate.estimate_files(path, None, context, cache=cache).parts["KV cache"]
    assert abs(planned / 2**20 - reported["K"] - reported["V"]) < 0.011, (planned / 2**20, reported)


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (("--cache-type", "q5_0"), ("--cache-type must be f16, q8_0 or q4_0, got 'q5_0'",)),
        (("--cache-type-v", "Q8_0"), ("--cache-type-v must be f16, q8_0 or q4_0, got 'Q8_0'",)),
    ],
)
def test_a_cache_type_dflash_does_not_offer_is_one_sentence(args, fragments, tiny_gguf):
    result = invoke("generate", "--target", tiny_gguf["f16"], "--prompt", "hi", "--max-new-tokens", "2", *args)
    assert_one_error(result, *fragments)


def test_a_quantized_cache_on_a_torch_target_is_one_sentence():
    target = TINY / "target"
    result = invoke("generate", "--target", target, "--prompt", "hi", "--max-new-tokens", "2", "--cache-type", "q8_0")
    assert_one_error(result, f"A quantized KV cache (q8_0) is llama.cpp's, and {target} runs on torch", "f16")


def test_a_cache_type_llamacpp_rejects_is_its_reason_in_one_sentence(archs):
    """qwen35 with 16-wide heads: a q4_0 K cache (blocks of 32 values) is refused by llama.cpp, in its words."""
    args = ("--prompt-ids", "5,17", "--max-new-tokens", "2", "--no-draft", "--cache-type-k", "q4_0")
    result = invoke("generate", "--target", archs / "qwen35" / "model.gguf", *args)
    assert_one_error(result, "could not create a", "K cache type q4_0 with block size 32 does not divide n_embd_head_k")


@pytest.mark.parametrize(
    ("args", "types", "shown"),
    [
        (("--cache-type", "q4_0"), ("q4_0", "q4_0"), "q4_0"),
        (("--cache-type-k", "q8_0"), ("q8_0", "f16"), "K q8_0, V f16"),
    ],
)
def test_generate_says_which_cache_types_the_target_runs_with(args, types, shown, tiny_gguf, tmp_path):
    """`generate --json`'s devices and the load's placed line name the K and V types llama.cpp was given."""
    result = invoke(
        "generate", "--target", tiny_gguf["f16"], "--prompt", "hi", "--max-new-tokens", "2", "--json", *args,
        env={"DFLASH_HOME": str(tmp_path)},
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    assert tuple(json.loads(result.stdout)["devices"]["target"]["kv_cache"].values()) == types
    assert f"placed: target on CPU, KV cache {shown}\n" in result.stderr, result.stderr
