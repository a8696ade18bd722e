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

from dflash_local import generation  # noqa: E402
from dflash_local.decode import Settings, run  # noqa: E402
from dflash_local.drafters.native import NativeDrafter  # noqa: E402
from dflash_local.drafters.torch_drafter import DFlashDrafter  # noqa: E402
from dflash_local.errors import DFlashError  # noqa: E402
from dflash_local.gguf.convert import convert  # noqa: E402
from dflash_local.gguf.file import UnreadStrings, read_gguf, read_header  # noqa: E402
from dflash_local.paths import state_dir  # noqa: E402
from dflash_local.runtime import LoadSpec, RuntimeConfig  # noqa: E402
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
    """The tensor attributes of the target and of its borrowed rows (`rows`) as large as a vocab x hidden matrix."""
    size = target.vocab_size * target.hidden_size
    held = [*vars(target).values(), *vars(target.rows).values()]
    return [v for v in held if isinstance(v, torch.Tensor) and v.numel() >= size]


def cached_ggufs() -> list[Path]:
    return sorted((state_dir() / "native-drafters").glob("*"))


def test_embeddings_and_head_are_read_from_the_file_only_when_the_torch_drafter_asks(q8_gguf, prompt):
    """Native drafter: no vocab x hidden tensor in the target. Torch drafter: one head copy in its dtype, values equal
    to the whole dequantized tensor, and the same greedy ids."""
    target = LlamaCppTarget.load(q8_gguf, LoadSpec(RuntimeConfig(threads=1), max_context=512))
    native = NativeDrafter.load(TINY / "drafter", target, LoadSpec(RuntimeConfig(threads=1)))
    settings = Settings(max_new_tokens=12, block_size=8)
    expected, _ = run(target, None, prompt, Settings(max_new_tokens=12, draft=False))
    assert run(target, native, prompt, settings)[0] == expected
    assert vocab_matrices(target) == []
    drafter = DFlashDrafter.load(TINY / "drafter", LoadSpec(max_context=512))
    assert run(target, drafter, prompt, settings)[0] == expected
    (head,) = vocab_matrices(target)
    assert head.dtype == target.dtype == torch.float32
    (tensor,) = [t for t in gguf.GGUFReader(str(q8_gguf)).tensors if t.name == "token_embd.weight"]  # tied head
    full = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type))
    assert torch.equal(head, full)
    ids = torch.tensor([[0, 5], [4095, 17]])
    assert torch.equal(target.embed(ids), full[ids])
    assert torch.equal(
        LlamaCppTarget.load(q8_gguf, LoadSpec(RuntimeConfig(threads=1), max_context=16)).embed(ids), full[ids]
    )  # from the file
    hidden = torch.randn(3, target.hidden_size, generator=torch.Generator().manual_seed(0))
    assert torch.equal(target.lm_head(hidden), hidden @ full.T)


def test_native_drafter_gguf_is_written_once_and_rebuilt_when_broken(q8_gguf, tmp_path):
    folder = tmp_path / "drafter"
    shutil.copytree(TINY / "drafter", folder)
    before = set(cached_ggufs())
    target = LlamaCppTarget.load(q8_gguf, LoadSpec(RuntimeConfig(threads=1), max_context=512))
    NativeDrafter.load(folder, target, LoadSpec(RuntimeConfig(threads=1)))
    (path,) = set(cached_ggufs()) - before
    first = path.stat()
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(str(path)).tensors}
    assert types["blk.0.attn_q.weight"] == types["blk.0.ffn_down.weight"] == gguf.GGMLQuantizationType.F16
    assert types["fc.weight"] == types["output_norm.weight"] == gguf.GGMLQuantizationType.F32  # fc: raw features
    NativeDrafter.load(folder, target, LoadSpec(RuntimeConfig(threads=1)))
    again = path.stat()
    assert (again.st_ino, again.st_mtime_ns) == (first.st_ino, first.st_mtime_ns)
    for broken in (path.read_bytes()[: first.st_size // 2], b"not a gguf"):
        path.write_bytes(broken)
        NativeDrafter.load(folder, target, LoadSpec(RuntimeConfig(threads=1)))
        assert path.stat().st_size == first.st_size
    assert set(cached_ggufs()) - before == {path}  # no .partial file left behind
    rebuilt = path.stat()
    weights = folder / "model.safetensors"
    os.utime(weights, ns=(first.st_mtime_ns, first.st_mtime_ns + 10**9))  # the drafter changed: written anew, in place
    NativeDrafter.load(folder, target, LoadSpec(RuntimeConfig(threads=1)))
    assert path.stat().st_ino != rebuilt.st_ino and set(cached_ggufs()) - before == {path}


def test_greedy_forward_returns_argmax_ids_and_native_drafter_rows_line_up(q8_gguf, prompt):
    """A greedy forward gives the logits' argmax and the same features; the native drafter's rows are the torch
    drafter's, and asking for fewer returns a prefix."""
    target = LlamaCppTarget.load(q8_gguf, LoadSpec(RuntimeConfig(threads=1), max_context=512))
    native = NativeDrafter.load(TINY / "drafter", target, LoadSpec(RuntimeConfig(threads=1)))
    target.set_feature_layers(native.target_layer_ids)
    block = torch.tensor(prompt[-12:])
    outs = []
    for greedy in (False, True):
        target.trim(0)
        target.forward(torch.tensor(prompt))
        outs.append(target.forward(block, greedy=greedy))
    full, ids = outs
    assert ids.logits is None and torch.equal(ids.argmax, full.logits.argmax(dim=-1))
    assert torch.equal(ids.features, full.features)
    tokens = prompt + prompt[-12:]
    drafts = []
    for drafter, rows in (
        (DFlashDrafter.load(TINY / "drafter", LoadSpec(max_context=512)), None),
        (native, None),
        (native, 3),
    ):
        drafter.trim(0)
        target.trim(0)
        context = target.forward(torch.tensor(tokens[:-1]), all_logits=False).features
        drafts.append(drafter.propose(target, context, tokens, len(tokens) - 1, 8, rows))
    want, got, first = drafts
    assert got.shape[0] == 7 and torch.equal(first, got[:3])
    assert ((got - want).norm(dim=-1) / want.norm(dim=-1)).max() < 0.01  # row i is position i (F16: 0.003 apart)


def test_header_reader_matches_gguf_py_without_reading_the_vocabulary(q8_gguf, tmp_path):
    """read_header gives gguf-py's metadata and tensor table, string arrays as their lengths unless asked for; a cut
    file is refused naming the first tensor past its end."""
    reader = gguf.GGUFReader(str(q8_gguf))
    expected = {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}
    fields = read_header(q8_gguf).fields
    unread = {key for key, value in fields.items() if isinstance(value, UnreadStrings)}
    assert unread == {"tokenizer.ggml.tokens", "tokenizer.ggml.merges"}
    assert {key: len(expected[key]) for key in unread} == {key: len(fields[key]) for key in unread}
    assert {k: v for k, v in fields.items() if k not in unread} == {
        k: v for k, v in expected.items() if k not in unread
    }
    assert read_header(q8_gguf, strings=unread).fields == expected
    table = {t.name: (t.tensor_type, tuple(int(n) for n in t.shape), t.data_offset, t.n_bytes) for t in reader.tensors}
    header = read_header(q8_gguf)
    assert {t.name: (t.tensor_type, t.shape, t.data_offset, t.n_bytes) for t in header.tensors.values()} == table
    cut = q8_gguf.stat().st_size * 2 // 3
    first = next(t for t in reader.tensors if t.data_offset + t.n_bytes > cut)
    broken = tmp_path / "cut.gguf"
    broken.write_bytes(q8_gguf.read_bytes()[:cut])
    with pytest.raises(DFlashError) as caught:
        read_gguf(broken)
    message = f"{broken} is not a complete, readable GGUF file (tensor {first.name} runs past the end of the file)."
    assert str(caught.value) == message


def test_second_load_parses_no_vocabulary_in_python_and_loads_it_once(q8_gguf, monkeypatch):
    """With the native drafter's GGUF cached, loading the pair never runs gguf-py's reader (seconds per 128K vocabulary)
    and llama.cpp loads two models, target and drafter: the tokenizer is the target's vocabulary."""
    spec = LoadSpec(RuntimeConfig(drafter="native", threads=1), max_context=256)
    generation.load_models(q8_gguf, TINY / "drafter", spec, auto_block=False)
    import llama_cpp

    loads = []
    load_model = llama_cpp.llama_model_load_from_file
    monkeypatch.setattr(
        llama_cpp, "llama_model_load_from_file", lambda *args: loads.append(args[0]) or load_model(*args)
    )
    monkeypatch.setattr(gguf, "GGUFReader", None)
    models = generation.load_models(q8_gguf, TINY / "drafter", spec, auto_block=False)
    assert len(loads) == 2 and loads[0] == str(q8_gguf).encode()
    text = "def main():\n    return 1"
    assert models.tokenizer.encode(text) == TextTokenizer.load(TINY / "target").encode(text)


def test_the_dimensions_are_one_record_wherever_read(q8_gguf):
    """The tiny target's dimensions read from its config.json (the torch target's config, memory estimates) and from
    its GGUF (the llama.cpp target's header, memory estimates, the training pipeline) are the same Dimensions."""
    from dflash_local.memory_estimate import target_sizes
    from dflash_local.targets.torch_llama import TargetConfig
    from dflash_local.train.pipeline import gguf_target_config
    from dflash_local.weights import read_config

    dims = TargetConfig.from_dict(read_config(TINY / "target"), TINY / "target").dims
    assert dims.vocab > 0 and dims.tied and dims.head_dim * dims.heads == dims.hidden
    assert target_sizes(TINY / "target") == dims
    assert target_sizes(q8_gguf) == dims
    assert gguf_target_config(q8_gguf).dims == dims
    assert read_gguf(q8_gguf).dims == dims


def _hybrid_gguf(path: Path, kv_heads: list[int]) -> Path:
    """A header-only lfm2 GGUF whose KV heads are stated per layer."""
    writer = gguf.GGUFWriter(str(path), "lfm2")
    writer.add_block_count(len(kv_heads))
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_context_length(64)
    writer.add_vocab_size(16)
    writer.add_head_count(2)
    writer.add_head_count_kv(kv_heads)
    writer.add_tensor("token_embd.weight", gguf.np.zeros((16, 8), dtype=gguf.np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_widths_stated_per_layer_read_as_the_attention_layers_one_value(tmp_path):
    """A hybrid model states its KV heads per layer, 0 for its layers without attention: the attention layers' one
    value is the width (what a drafter trained for it and a memory estimate take); where they differ it reads 0,
    read_gguf (what the llama.cpp target checks) passes and a memory estimate says in one sentence it cannot."""
    from dflash_local.memory_estimate import target_sizes

    hybrid = _hybrid_gguf(tmp_path / "hybrid.gguf", [0, 1, 0])
    dims = read_gguf(hybrid).dims
    assert (dims.hidden, dims.intermediate, dims.layers, dims.heads, dims.kv_heads) == (8, 16, 3, 2, 1)
    assert (dims.head_dim, dims.vocab, dims.tied) == (4, 16, True)
    assert target_sizes(hybrid) == dims
    varied = _hybrid_gguf(tmp_path / "varied.gguf", [0, 1, 2])
    assert read_gguf(varied).dims.kv_heads == 0
    with pytest.raises(DFlashError) as caught:
        target_sizes(varied)
    reason = "a width varies by layer or is missing"
    assert str(caught.value) == f"{varied} is not a GGUF file whose shape can be read ({reason})."
