"""At T > 0 with an image in the prompt, DFlash's continuations follow the target's distribution: four new tokens after
gemma3-vision's image prompt (text, a 16-row image, text) at temperature 1.5 and top-k 3, against the exact
distribution of the 81 continuations enumerated from logits dflash did not compute: llama.cpp's own, in a context of
their own, the prompt fed by libmtmd's helper (mtmd_helper_eval_chunks: its own encoding and non-causal image batch)
and each prefix after it by llama_decode, truncated by tests/sampled_reference.py's own temperature and top-k. Half
the samples at block 3 with a chain drafter proposing from those logits, its argmax raised (its drafts are accepted,
rejected and fully accepted with their bonus), half under --block-size auto's policy with the drafter `dflash train`
trained for the text model (conftest's vision_drafter) and lookup's drafts (fully accepted blocks among them).

The power calculation is test_sampled_lossless's: the three wrong samplers of tests/wrong_samplers.py moved this
test's continuations by Cohen's w^2 of 0.061 (residual), 0.107 (accept-p) and 0.078 (bonus-row) (MEASURED_EFFECTS;
`python tests/wrong_samplers.py NAME tests/test_vision_sampled.py` prints them in its failure), and the test draws the
fewest samples at which 0.75 times the smallest is found with 99% power at alpha = 1e-3."""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
from sampled_reference import continuations, effect_size, p_value, samples_for_power
from test_architectures import ChainDrafter
from test_sampled_lossless import llamacpp_model, short_block_policy
from test_vision import image_chunks, pixels

from dflash_local.decode import Settings, generate
from dflash_local.drafters.torch_drafter import DFlashDrafter
from dflash_local.llama_lib import llama_cpp
from dflash_local.runtime import LoadSpec, RuntimeConfig
from dflash_local.sampling import SamplingParams
from dflash_local.session import Session
from dflash_local.targets.llamacpp import LlamaCppTarget
from dflash_local.vision import Projector, prefill

PARAMS, NEW_TOKENS, CHAIN_BLOCK = SamplingParams(temperature=1.5, top_k=3), 4, 3
MEASURED_EFFECTS = {"residual": 0.061, "accept-p": 0.107, "bonus-row": 0.078}  # w^2 per wrong sampler (docstring)
EFFECT_FLOOR = 0.75 * min(MEASURED_EFFECTS.values())


def llamacpp_image_logits(model: Path, seed: int) -> Callable[[list[list[int]]], list[Sequence[float]]]:
    """llama.cpp's own logits of the token after image_chunks(seed)'s prompt followed by each prefix: the prompt fed
    once by mtmd_helper_eval_chunks into a llama-cpp-python context, each prefix by llama_decode after dropping the
    previous one from its memory."""
    own = llamacpp_model(model / "model.gguf")
    projector = Projector(model / "mmproj.gguf", own.model, 1)  # libmtmd's context for this model (its init only)
    mtmd, ctx = projector.mtmd, own.ctx
    text = f"Look: {projector.marker} What is it?".encode()  # image_chunks' prompt
    given = mtmd.mtmd_input_text(text, len(text), True, True)
    bitmaps = (mtmd.mtmd_bitmap_p_ctypes * 1)(projector.bitmap_of_pixels(pixels(seed)))
    chunks, fed = mtmd.mtmd_input_chunks_init(), llama_cpp.llama_pos(0)
    try:
        assert mtmd.mtmd_tokenize(projector.ctx, chunks, ctypes.byref(given), bitmaps, 1) == 0
        assert mtmd.mtmd_helper_eval_chunks(projector.ctx, ctx, chunks, 0, 0, 64, True, ctypes.byref(fed)) == 0
    finally:
        mtmd.mtmd_input_chunks_free(chunks)
        mtmd.mtmd_bitmap_free(bitmaps[0])
    vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(own.model))
    after_prompt = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, -1), shape=(vocab,)).copy()
    memory = llama_cpp.llama_get_memory(ctx)

    def next_logits(prefixes: list[list[int]]) -> list[Sequence[float]]:
        rows = []
        for prefix in prefixes:
            if not prefix:
                rows.append(after_prompt)
                continue
            assert llama_cpp.llama_memory_seq_rm(memory, 0, fed.value, -1)
            tokens = (llama_cpp.llama_token * len(prefix))(*prefix)
            assert llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(tokens, len(prefix))) == 0
            rows.append(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, -1), shape=(vocab,)).copy())
        return rows

    next_logits.own = own  # kept alive with the function
    return next_logits


class ImageChainDrafter(ChainDrafter):
    """test_architectures' ChainDrafter after an image prompt: row i holds llama.cpp's own logits (next_logits, as
    llamacpp_image_logits gives them) after the prompt, the tokens since it and i tokens of their greedy chain, the
    argmax raised by BOOST, so its drafts are often right and often rejected."""

    BOOST = 1.0  # the argmax's q a little above its p: rejected now and then, kept with min(1, p / q) near 1

    def __init__(self, next_logits, prompt_length: int, block_size: int) -> None:
        super().__init__(None, block_size)
        self.next_logits, self.prompt_length = next_logits, prompt_length

    def propose(self, target, new_features, tokens: list[int], start: int, size: int, rows: int | None = None):
        """The chain's rows for positions start+1..start+rows (default size - 1)."""
        prefix, out = list(tokens[self.prompt_length : start + 1]), []
        for _ in range(size - 1 if rows is None else rows):
            logits = torch.as_tensor(self.next_logits([prefix])[0]).clone()
            best = int(logits.argmax())
            logits[best] += self.BOOST
            out.append(logits)
            prefix.append(best)
        return torch.stack(out)


def test_sampled_continuations_after_an_image_follow_llama_cpp_distribution(vision_model, vision_drafter):
    """Four tokens after an image prompt, half at block 3 by the image chain drafter (drafts accepted, rejected and
    fully accepted with their bonus) and half under auto with the trained drafter and lookup (fully accepted blocks
    among them): the chi-square against llama.cpp's enumerated distribution passes."""
    reference = llamacpp_image_logits(vision_model, 0)
    exact = continuations(reference, [], NEW_TOKENS, PARAMS.temperature, PARAMS.top_k, PARAMS.top_p)
    samples = samples_for_power(EFFECT_FLOOR, exact)
    target = LlamaCppTarget.load(vision_model / "model.gguf", LoadSpec(RuntimeConfig(threads=1), max_context=64))
    projector = Projector(vision_model / "mmproj.gguf", target.context.model, 1)
    trained = DFlashDrafter.load(vision_drafter, LoadSpec(max_context=64))
    chunks = image_chunks(projector, 0)
    chain = ImageChainDrafter(reference, sum(map(len, chunks)), CHAIN_BLOCK)
    policy = short_block_policy(trained.block_size)
    counts: dict[tuple[int, ...], int] = {}
    steps: dict[str, list[tuple[int, int]]] = {"chain": [], "auto": []}
    for seed in range(samples):
        mode = "auto" if seed % 2 else "chain"
        drafter, chosen = (trained, policy) if mode == "auto" else (chain, None)
        settings = Settings(NEW_TOKENS, PARAMS, None if mode == "auto" else CHAIN_BLOCK, seed=seed)
        session = Session()  # fresh caches: the image fed again, with the drafter's features
        prompt, _ = prefill(target, drafter, chunks, session)
        made = list(generate(target, drafter, prompt, settings, chosen, session))
        ids = tuple(token for step in made for token in step.token_ids)
        counts[ids] = counts.get(ids, 0) + 1
        steps[mode] += [(step.acceptance_length, step.block_size) for step in made if step.source != "plain"]
    found, effect = p_value(exact, counts), effect_size(exact, counts)
    taus = {mode: round(sum(n for n, _ in verified) / len(verified), 2) for mode, verified in steps.items()}
    print(f"image prompt, T>0: p = {found:.3g}, w^2 = {effect:.4f}, {samples} samples, {len(exact)} sequences, {taus}")
    assert found > 1e-3, f"p = {found:.3g}, effect size w^2 = {effect:.4f} over {samples} samples"
    chain_steps = steps["chain"]
    assert taus["chain"] > 1.3 and sum(n < k for n, k in chain_steps) > len(chain_steps) / 20, taus  # rollbacks
    for mode, verified in steps.items():
        assert sum(n == k for n, k in verified) > samples / 40, (mode, verified)  # all kept, and the bonus
