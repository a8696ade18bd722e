"""`dflash convert`: an HF-layout Llama/Qwen3 target to one GGUF file, quantized by llama.cpp's own quantizer."""

from __future__ import annotations

import ctypes
import json
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from ..atomic import unwritable_reason
from ..errors import DFlashError
from ..llama_lib import llama_cpp, quiet_llama_logs
from ..target_config import TargetConfig
from ..weights import StoredTensor, read_config, read_stored, stored_tensors
from .shape import LAYER_TENSORS, add_shape, rope_factors

# llama_ftype values from llama.h.
FILE_TYPES = {"f16": 1, "bf16": 32, "q8_0": 7, "q6_k": 18, "q5_k_m": 17, "q4_k_m": 15, "q4_0": 2}


def _to_neox_interleaved(weight: np.ndarray, heads: int) -> np.ndarray:
    """Reorder q/k rows from HF's rotate-half RoPE layout to llama.cpp's interleaved one (llama arch)."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


@dataclass(frozen=True)
class _Planned:
    """One tensor of the staged GGUF: its source in the safetensors files and the row reorder it needs."""

    name: str
    source: StoredTensor
    heads: int | None = None  # q/k of llama models: rows reordered for llama.cpp's RoPE layout


def _plan(cfg: TargetConfig, folder: Path) -> list[_Planned]:
    """The GGUF tensors in the order they are written (the safetensors files' order), checked before any is read."""
    if cfg.attention_bias or cfg.mlp_bias:
        raise DFlashError(f"{folder}: attention or MLP biases are not supported by the GGUF converter.")
    plan: list[_Planned] = []
    for name, source in stored_tensors(folder).items():
        if name == "model.embed_tokens.weight":
            plan.append(_Planned("token_embd.weight", source))
        elif name == "model.norm.weight":
            plan.append(_Planned("output_norm.weight", source))
        elif name == "lm_head.weight":
            if not cfg.dims.tied:
                plan.append(_Planned("output.weight", source))
        elif name.startswith("model.layers."):
            index, rest = name[len("model.layers.") :].split(".", 1)
            if rest not in LAYER_TENSORS:
                raise DFlashError(f"{folder}: tensor {name} has no GGUF counterpart.")
            heads = {"self_attn.q_proj.weight": cfg.dims.heads, "self_attn.k_proj.weight": cfg.dims.kv_heads}.get(rest)
            plan.append(
                _Planned(f"blk.{index}.{LAYER_TENSORS[rest]}", source, heads if cfg.model_type == "llama" else None)
            )
        else:
            raise DFlashError(f"{folder}: tensor {name} has no GGUF counterpart.")
    for entry in plan:
        if entry.source.dtype not in STAGED_TYPES:
            raise DFlashError(f"{entry.source.path}: tensors of type {entry.source.dtype} cannot be converted.")
    named = {entry.name for entry in plan}
    needed = ["token_embd.weight", "output_norm.weight"] + ([] if cfg.dims.tied else ["output.weight"])
    missing = [name for name in needed if name not in named]
    if missing:
        raise DFlashError(f"{folder} lacks the weights for GGUF tensor {missing[0]}.")
    return plan


# safetensors dtype -> the GGUF type its matrices are staged in, losslessly (vectors are staged in F32)
STAGED_TYPES = {
    "F32": gguf.GGMLQuantizationType.F32,
    "F16": gguf.GGMLQuantizationType.F16,
    "BF16": gguf.GGMLQuantizationType.BF16,
}


def _staged_type(source: StoredTensor) -> gguf.GGMLQuantizationType:
    return STAGED_TYPES[source.dtype] if len(source.shape) > 1 else gguf.GGMLQuantizationType.F32


def _staged_array(entry: _Planned) -> np.ndarray:
    """One tensor as it is staged: matrices with their stored bits (reordered for RoPE), vectors in float32."""
    array = read_stored(entry.source)
    if len(entry.source.shape) == 1:
        if entry.source.dtype == "BF16":
            return (array.astype(np.uint32) << 16).view(np.float32)
        return array.astype(np.float32)
    if entry.heads is not None:
        array = _to_neox_interleaved(array, entry.heads)
    return np.ascontiguousarray(array)


def _add_tokenizer(writer, folder: Path, cfg: TargetConfig) -> None:
    """tokenizer.json (byte-level BPE) as a gpt2-style GGUF tokenizer, plus special ids and chat template."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise DFlashError(f"{folder} has no tokenizer.json to put in the GGUF file.")
    spec = json.loads(path.read_text())
    model = spec.get("model") or {}
    pre = spec.get("pre_tokenizer") or {}
    pre_types = {pre.get("type")} | {p.get("type") for p in pre.get("pretokenizers", [])}
    if model.get("type") != "BPE" or "ByteLevel" not in pre_types:
        raise DFlashError(f"{path}: only byte-level BPE tokenizers can be converted to GGUF.")
    vocab: dict[str, int] = dict(model["vocab"])
    added = {token["content"]: token for token in spec.get("added_tokens", [])}
    for content, token in added.items():
        vocab[content] = token["id"]
    size = max(cfg.dims.vocab, max(vocab.values()) + 1)
    tokens = [f"[PAD{i}]" for i in range(size)]
    types = [gguf.TokenType.UNUSED] * size
    for content, index in vocab.items():
        tokens[index] = content
        special = added.get(content, {}).get("special")
        types[index] = (
            gguf.TokenType.CONTROL
            if special
            else gguf.TokenType.USER_DEFINED
            if content in added
            else gguf.TokenType.NORMAL
        )
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    tok_config_path = folder / "tokenizer_config.json"
    tok_config = json.loads(tok_config_path.read_text()) if tok_config_path.is_file() else {}
    writer.add_add_bos_token(bool(tok_config.get("add_bos_token", False)))
    for key, add in (
        ("bos_token", writer.add_bos_token_id),
        ("eos_token", writer.add_eos_token_id),
        ("pad_token", writer.add_pad_token_id),
    ):
        name = tok_config.get(key)
        name = name.get("content") if isinstance(name, dict) else name
        if name in vocab:
            add(vocab[name])
    if tok_config.get("chat_template"):
        writer.add_chat_template(tok_config["chat_template"])


def _write_staged(cfg: TargetConfig, folder: Path, out: Path) -> None:
    """Write the GGUF llama.cpp quantizes from, one tensor in memory at a time: matrices as stored (F32, F16 or
    BF16, lossless), norms and RoPE factors in F32 (they stay F32 through quantization)."""
    plan = _plan(cfg, folder)
    factors = rope_factors(cfg.raw, cfg.dims.head_dim)
    if factors is not None and cfg.model_type != "llama":
        raise DFlashError(f"{folder}: RoPE scaling is only converted for llama models.")
    writer = gguf.GGUFWriter(str(out), cfg.model_type)
    writer.add_name(folder.name)
    add_shape(writer, cfg, cfg.max_position_embeddings)
    writer.add_vocab_size(cfg.dims.vocab)
    writer.add_file_type(0)
    _add_tokenizer(writer, folder, cfg)
    for entry in plan:
        kind = _staged_type(entry.source)
        size = math.prod(entry.source.shape) * (4 if kind == gguf.GGMLQuantizationType.F32 else 2)
        writer.add_tensor_info(entry.name, entry.source.shape, np.dtype(np.float32), size, raw_dtype=kind)
    factor_array = None if factors is None else factors.numpy().astype(np.float32)
    if factor_array is not None:
        writer.add_tensor_info("rope_freqs.weight", factor_array.shape, factor_array.dtype, factor_array.nbytes)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for entry in plan:
        writer.write_tensor_data(_staged_array(entry))
    if factor_array is not None:
        writer.write_tensor_data(factor_array)
    writer.close()


def _quantize(src: Path, out: Path, kind: str, threads: int) -> None:
    """Run llama.cpp's llama_model_quantize from src (the staged GGUF) to out."""
    quiet_llama_logs()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FILE_TYPES[kind]
    params.nthread = threads
    status = llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), ctypes.byref(params))
    if status != 0:
        raise DFlashError(f"llama.cpp could not quantize the model to {kind} (status {status}).")


STAGING = ".dflash-convert-"  # <out>.dflash-convert-<pid>: a convert's working folder beside its output


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def remove_stale_staging(folder: Path) -> list[Path]:
    """Delete working folders that killed `dflash convert` runs left in folder (their pid is gone); return them."""
    stale = []
    for path in folder.glob(f"*{STAGING}*"):
        pid = path.name.rpartition(STAGING)[2]
        if path.is_dir() and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
            stale.append(path)
    return stale


def convert(source: Path, out: Path, kind: str = "f16", threads: int = 0) -> Path:
    """Convert an HF-layout Llama/Qwen3 folder to a GGUF file of the given type; return its path.

    The staged GGUF lives in `<out>.dflash-convert-<pid>/`, removed on exit, or by the next convert into the
    same folder when this process was killed.
    """
    source, out = Path(source), Path(out)
    if kind not in FILE_TYPES:
        raise DFlashError(f"Unknown GGUF type '{kind}' (use {', '.join(FILE_TYPES)}).")
    if out.suffix != ".gguf":
        raise DFlashError(f"The output file name must end in .gguf, not '{out.name}'.")
    if out.is_dir():
        raise DFlashError(f"--out {out} is an existing folder; name the GGUF file to write, e.g. {out / 'model.gguf'}.")
    reason = unwritable_reason(out.parent)
    if reason is not None:
        raise DFlashError(f"Cannot write {out}: its folder {out.parent} is not writable ({reason}).")
    cfg = TargetConfig.from_dict(read_config(source), source)
    remove_stale_staging(out.parent)
    work = out.with_name(f"{out.name}{STAGING}{os.getpid()}")
    work.mkdir(exist_ok=True)  # one left by an earlier process with our pid is stale too
    try:
        staged = work / "staged.gguf"
        _write_staged(cfg, source, staged)
        partial = work / out.name
        _quantize(staged, partial, kind, threads)
        partial.replace(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out
