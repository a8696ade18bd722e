"""`dflash convert` and `dflash generate` on GGUF files; bad GGUF input ends in one clear sentence."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from in_process import invoke
from one_error import assert_one_error
from test_cli import dflash

pytest.importorskip("llama_cpp")
gguf = pytest.importorskip("gguf")

TINY = Path(__file__).resolve().parent.parent / "models" / "tiny"
PROMPT_IDS = "94,1209,1011,267,2155,7,1021,30,1024,14"


@pytest.fixture(scope="module")
def q4(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gguf_cli") / "tiny-q4_k_m.gguf"
    result = invoke("convert", TINY / "target", "--out", out, "--type", "q4_k_m")
    assert result.exit_code == 0, result.stderr
    assert "q4_k_m" in result.stdout
    types = {tensor.tensor_type.name for tensor in gguf.GGUFReader(str(out)).tensors}
    assert {"Q4_K", "Q6_K"} <= types, types
    return out


def _generate(target: Path, *extra: str) -> dict:
    result = invoke(
        "generate", "--target", target, "--prompt-ids", PROMPT_IDS, "--max-new-tokens", "24", "--json", *extra
    )
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def test_generate_on_gguf_reports_tau_and_speed(q4):
    """Q4_K_M: llama.cpp's K-quant CPU kernels are not batch-invariant, so ids are compared on Q8_0 in test_gguf."""
    fast = _generate(q4, "--drafter", str(TINY / "drafter"), "--block-size", "8")
    slow = _generate(q4, "--no-draft", "--backend", "llamacpp")
    assert len(fast["output_ids"]) == len(slow["output_ids"]) == 24
    assert fast["tau"] > 1.0 and fast["decode_tokens_per_s"] > 0 and slow["decode_tokens_per_s"] > 0
    assert max(fast["acceptance_lengths"]) <= 8


def write_header_gguf(path: Path, arch: str, layers: int = 2) -> Path:
    """A small GGUF of any architecture name, with zero weights (its header is what these tests read of it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(layers)
    writer.add_embedding_length(8)
    writer.add_context_length(64)
    writer.add_vocab_size(16)
    writer.add_tensor("token_embd.weight", gguf.np.zeros((16, 8), dtype=gguf.np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def bad(tmp_path_factory, q4) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bad_gguf")
    truncated = root / "truncated.gguf"
    truncated.write_bytes(q4.read_bytes()[: q4.stat().st_size * 2 // 3])
    header_only = root / "header.gguf"
    header_only.write_bytes(q4.read_bytes()[:100])
    deep = root / "deep_drafter"
    shutil.copytree(TINY / "drafter", deep)
    config = json.loads((deep / "config.json").read_text())
    config["dflash_config"]["target_layer_ids"] = [1, 3, 9]
    (deep / "config.json").write_text(json.dumps(config))
    return {
        "gemma": write_header_gguf(root / "gemma.gguf", "gemma", 2),
        "incomplete": write_header_gguf(root / "incomplete.gguf", "llama", 2),
        "truncated": truncated,
        "header": header_only,
        "not_gguf": TINY / "heldout_prompts.jsonl",
        "deep": deep,
        "good": q4,
    }


CASES = {
    # any architecture is tried by llama.cpp (plain decoding needs no features); this one lacks its keys
    "architecture without its keys": ("gemma", [], "llama.cpp could not load"),
    "llama.cpp rejects it": ("incomplete", [], "llama.cpp could not load"),
    "truncated tensors": ("truncated", [], "is not a complete, readable GGUF file"),
    "truncated header": ("header", [], "is not a complete, readable GGUF file"),
    "not a GGUF file": ("not_gguf", ["--backend", "llamacpp"], "is not a complete, readable GGUF file"),
    "layer ids past the end": ("good", ["--drafter", "deep"], "layers [1, 3, 9], but the target has only 8"),
}
# where llama.cpp loads the file, in a process of its own: its whole stderr (llama.cpp's own log included) is one line
IN_A_PROCESS = {"architecture without its keys", "llama.cpp rejects it", "layer ids past the end"}


@pytest.mark.parametrize("case", CASES)
def test_bad_gguf_input_is_one_clear_sentence(case, bad):
    target, extra, message = CASES[case]
    extra = [str(bad.get(arg, arg)) for arg in extra]
    if "--drafter" not in extra:
        extra.append("--no-draft")
    args = ("generate", "--target", bad[target], "--prompt-ids", "1,2", *extra)
    # in a process where llama.cpp loads the file, else refused by dflash's own checks before llama.cpp sees it
    assert_one_error(dflash(*args) if case in IN_A_PROCESS else invoke(*args), message)


def test_convert_rejects_bad_requests(tmp_path):
    result = invoke("convert", TINY / "target", "--out", tmp_path / "x.gguf", "--type", "q3")
    assert result.exit_code == 1 and "Unknown GGUF type 'q3'" in result.stderr
    result = invoke("convert", TINY / "drafter", "--out", tmp_path / "x.gguf")
    assert result.exit_code == 1 and "has no GGUF counterpart" in result.stderr
