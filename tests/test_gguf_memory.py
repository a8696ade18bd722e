"""GGUF backend memory: no fp32 copies of the target's tensors, the native drafter's GGUF cached once in F16,
greedy verification reading argmax ids from llama.cpp."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("llama_cpp")
gguf = pytest.importorskip("gguf")

from dflash_local.decode import Settings, run  # noqa: E402
from dflash_local.drafter import DFlashDrafter  # noqa: E402
from dflash_local.gguf_convert import convert  # noqa: E402
from dflash_local.hub import state_dir  # noqa: E402
from dflash_local.native_drafter import NativeDrafter  # noqa: E402
from dflash_local.targets.llamacpp import LlamaCppTarget  # noqa: E402
from dflash_local.tokenizer import TextTokenizer  # noqa: E402

TINY = Path(__file__).resolve().parent.parent / "models" / "tiny"


@pytest.fixture(scope="module")
def q8_gguf(tmp_path_factory) -> Path:
    """The bundled tiny target (tied head) as Q8_0: its embeddings are quantized."""
    return convert(TINY / "target", tmp_path_factory.mktemp("gguf-memory") / "tiny-q8_0.gguf", "q8_0", threads=1)


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    line = (TINY / "heldout_prompts.jsonl").read_text().splitlines()[0]
    return TextTokenizer.load(TINY / "target").encode(json.loads(line)["prompt"])[-32:]


def vocab_matrices(target: LlamaCppTarget) -> list[torch.Tensor]:
    """The target's tensor attributes as large as a vocab x hidden matrix."""
    size = target.vocab_size * target.hidden_size
    return [v for v in vars(target).values() if isinstance(v, torch.Tensor) and v.numel() >= size]


def cached_ggufs() -> list[Path]:
    return sorted((state_dir() / "native-drafters").glob("*"))


def test_embeddings_and_head_are_read_from_the_file_only_when_the_torch_drafter_asks(q8_gguf, prompt):
    """Native drafter: no vocab x hidden tensor in the target. Torch drafter: one head copy in its dtype, values equal
    to the whole dequantized tensor, and the same greedy ids."""
    target = LlamaCppTarget.load(q8_gguf, max_context=512, threads=1)
    native = NativeDrafter.load(TINY / "drafter", target, threads=1)
    settings = Settings(max_new_tokens=12, block_size=8)
    expected, _ = run(target, None, prompt, Settings(max_new_tokens=12, draft=False))
    assert run(target, native, prompt, settings)[0] == expected
    assert vocab_matrices(target) == []
    drafter = DFlashDrafter.load(TINY / "drafter", max_context=512)
    assert run(target, drafter, prompt, settings)[0] == expected
    (head,) = vocab_matrices(target)
    assert head.dtype == target.dtype == torch.float32
    (tensor,) = [t for t in gguf.GGUFReader(str(q8_gguf)).tensors if t.name == "token_embd.weight"]  # tied head
    full = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type))
    assert torch.equal(head, full)
    ids = torch.tensor([[0, 5], [4095, 17]])
    assert torch.equal(target.embed(ids), full[ids])
    assert torch.equal(LlamaCppTarget.load(q8_gguf, max_context=16, threads=1).embed(ids), full[ids])  # from the file
    hidden = torch.randn(3, target.hidden_size, generator=torch.Generator().manual_seed(0))
    assert torch.equal(target.lm_head(hidden), hidden @ full.T)


def test_native_drafter_gguf_is_written_once_in_f16_and_rebuilt_when_broken(q8_gguf, tmp_path):
    folder = tmp_path / "drafter"
    shutil.copytree(TINY / "drafter", folder)
    before = set(cached_ggufs())
    target = LlamaCppTarget.load(q8_gguf, max_context=512, threads=1)
    NativeDrafter.load(folder, target, threads=1)
    (path,) = set(cached_ggufs()) - before
    first = path.stat()
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(str(path)).tensors}
    assert types["fc.weight"] == types["blk.0.attn_q.weight"] == gguf.GGMLQuantizationType.F16
    assert types["output_norm.weight"] == gguf.GGMLQuantizationType.F32
    NativeDrafter.load(folder, target, threads=1)
    again = path.stat()
    assert (again.st_ino, again.st_mtime_ns) == (first.st_ino, first.st_mtime_ns)
    for broken in (path.read_bytes()[: first.st_size // 2], b"not a gguf"):
        path.write_bytes(broken)
        NativeDrafter.load(folder, target, threads=1)
        assert path.stat().st_size == first.st_size
    assert set(cached_ggufs()) - before == {path}  # no .partial file left behind
    rebuilt = path.stat()
    weights = folder / "model.safetensors"
    os.utime(weights, ns=(first.st_mtime_ns, first.st_mtime_ns + 10**9))  # the drafter changed: written anew, in place
    NativeDrafter.load(folder, target, threads=1)
    assert path.stat().st_ino != rebuilt.st_ino and set(cached_ggufs()) - before == {path}


def test_greedy_forward_returns_argmax_ids_and_native_drafter_rows_line_up(q8_gguf, prompt):
    """A greedy forward gives the logits' argmax and the same features; the native drafter's rows are the torch
    drafter's, and asking for fewer returns a prefix."""
    target = LlamaCppTarget.load(q8_gguf, max_context=512, threads=1)
    native = NativeDrafter.load(TINY / "drafter", target, threads=1)
    target.set_feature_layers(native.target_layer_ids)
    block = torch.tensor(prompt[-12:])
    outs = []
    for greedy in (False, True):
        target.reset()
        target.forward(torch.tensor(prompt))
        outs.append(target.forward(block, greedy=greedy))
    full, ids = outs
    assert ids.logits is None and torch.equal(ids.argmax, full.logits.argmax(dim=-1))
    assert torch.equal(ids.features, full.features)
    tokens = prompt + prompt[-12:]
    drafts = []
    for drafter, rows in ((DFlashDrafter.load(TINY / "drafter", max_context=512), None), (native, None), (native, 3)):
        drafter.reset()
        target.reset()
        context = target.forward(torch.tensor(tokens[:-1]), all_logits=False).features
        drafts.append(drafter.propose(target, context, tokens, len(tokens) - 1, 8, rows))
    want, got, first = drafts
    assert got.shape[0] == 7 and torch.equal(first, got[:3])
    assert ((got - want).norm(dim=-1) / want.norm(dim=-1)).max() < 0.01  # row i is position i (F16: 0.003 apart)
