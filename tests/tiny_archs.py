"""Tiny random-weight models of the 2026 architectures: a transformers model of tiny sizes, written to GGUF by
llama.cpp's own converter, with a real vocabulary copied from llama.cpp's models/ggml-vocab-*.gguf.

`qwen35-mtp` is qwen35 with one multi-token-prediction (MTP) block, as Qwen3.5's checkpoints hold it (`mtp.*`), which
the converter writes as llama.cpp's nextn layer; `mtp_reference` computes that block's logits with transformers' own
modules, the reference for dflash's MTP drafter. `lfm2-weak` is lfm2 with weak layers: like qwen35-mtp's trunk it
mostly repeats its last token, so lookup's drafts of its own output are accepted (blocks past a verify's 8 rows).
`gemma3-vision` is a Gemma 3 with a tiny SigLIP vision tower (Gemma3ForConditionalGeneration): its text model goes to
model.gguf, its vision tower and projector to mmproj.gguf (the converter's --mmproj), its text config alone to hf-text/
(what a drafter is shaped for); `image_features` is transformers' vision tower + projector on given pixels.

Runs in the oracle environment (torch + transformers), with llama.cpp's source tree (the llama-cpp-python sdist's
vendor/llama.cpp: its converter and gguf-py) on the path:
  python tests/tiny_archs.py LLAMA_CPP_DIR OUT_DIR ARCH...   # writes OUT_DIR/ARCH/model.gguf and OUT_DIR/ARCH/hf/
  python tests/tiny_archs.py --mtp-reference HF_DIR OUT_FILE ROWS TOKEN...   # the MTP chain's logits (safetensors)
  python tests/tiny_archs.py --image-features HF_DIR PIXELS_FILE OUT_FILE   # an image's embeddings (safetensors)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1)
# The transformers config of each architecture (TINY's sizes, and its own) and the vocabulary file its GGUF gets.
ARCHS: dict[str, tuple[str, str, dict]] = {
    "qwen35": (
        "Qwen3_5TextConfig",
        "qwen2",
        dict(
            **TINY,
            head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
            rope_parameters=dict(
                rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5, mrope_section=[2, 1, 1]
            ),
            tie_word_embeddings=True,
        ),
    ),
    "qwen3moe": (
        "Qwen3MoeConfig",
        "qwen2",
        dict(
            **TINY,
            moe_intermediate_size=32,
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=True,  # as the published Qwen3 MoE models (llama.cpp's qwen3moe graph normalizes)
            tie_word_embeddings=True,
        ),
    ),
    "gemma4": (
        "Gemma4TextConfig",
        "gemma-4",
        dict(
            **TINY,
            head_dim=16,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            hidden_size_per_layer_input=0,
        ),
    ),
    "gpt-oss": (
        "GptOssConfig",
        "gpt-2",
        dict(
            **(TINY | dict(intermediate_size=32)),
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        ),
    ),
    "lfm2": (
        "Lfm2Config",
        "llama-bpe",
        dict(
            **TINY,
            layer_types=["conv", "full_attention", "conv", "full_attention"],
            block_auto_adjust_ff_dim=False,  # the feed-forward width as given
            tie_word_embeddings=True,
        ),
    ),
}
# qwen35 with 64-wide heads: llama.cpp's quantized KV caches (q8_0, q4_0) store K and V in blocks of 32 values per
# head, and rotate 64-wide (or wider) heads by a Hadamard matrix before quantizing them
ARCHS["qwen35-h64"] = ARCHS["qwen35"][:2] + (
    ARCHS["qwen35"][2]
    | dict(
        head_dim=64,
        rope_parameters=dict(
            rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5, mrope_section=[8, 4, 4]
        ),
    ),
)
ARCH_NAMES = {"Qwen3_5TextConfig": "Qwen3_5ForCausalLM"}  # the architectures entry the converter knows
WEAK_VARIANTS = {"qwen35-mtp": "qwen35", "lfm2-weak": "lfm2"}  # architectures with weak layers: the one each extends
WITH_MTP = ("qwen35-mtp",)  # variants with one MTP block
WEAK = 0.02  # the weak variants' layer weights: their stream stays near each token's embedding (it mostly repeats its
# last token), and qwen35-mtp's MTP block passes the embedding through, so the block's drafts are often right, and
# often not
VISION = dict(  # gemma3-vision's SigLIP tower: 112-pixel images of 8x8 patches, pooled to 4x4 = 16 image rows
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=112, patch_size=14
)
IMAGE_ROWS = 16  # gemma3-vision's rows per image (mm_tokens_per_image)
HIDDEN = 0.05  # the weights of the hidden state's half of its MTP block's fc: the hidden state moves its drafts' logits


def vocabulary(llama_cpp: Path, name: str) -> list:
    """The tokenizer.* fields of llama.cpp's vocabulary file `name`, as gguf-py reader fields."""
    import gguf

    reader = gguf.GGUFReader(llama_cpp / "models" / f"ggml-vocab-{name}.gguf")
    return [field for key, field in reader.fields.items() if key.startswith("tokenizer.")]


def copy_vocabulary(writer, fields: list) -> None:
    """Add the vocabulary fields to a GGUF writer (in place of the converter's HF tokenizer reading)."""
    import gguf

    for field in fields:
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(field.name, field.contents(), kind, sub_type=field.types[1])
        else:
            writer.add_key_value(field.name, field.contents(), kind)


def build(llama_cpp: Path, arch: str, out: Path) -> Path:
    """Write a seeded random tiny model of `arch` to out/hf and its GGUF (F32) to out/model.gguf."""
    import torch
    import transformers

    config_name, vocab_name, sizes = ARCHS[WEAK_VARIANTS.get(arch, arch)]
    fields = vocabulary(llama_cpp, vocab_name)
    tokens = next(f for f in fields if f.name == "tokenizer.ggml.tokens")
    config = getattr(transformers, config_name)(vocab_size=len(tokens.data), max_position_embeddings=4096, **sizes)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # larger weights than the default init: logits far from uniform, so greedy ids differ
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, WEAK if arch in WEAK_VARIANTS and "embed" not in name else 0.2)
    model.config.architectures = [ARCH_NAMES.get(config_name, type(model).__name__)]
    model.save_pretrained(out / "hf")
    if arch in WITH_MTP:
        add_mtp_block(out / "hf", config)
    if arch == "gemma4":  # the converter reads the full-attention layers' head size from a field transformers omits,
        # and the vocabulary's size from tokenizer.json
        written = json.loads((out / "hf" / "config.json").read_text())
        (out / "hf" / "config.json").write_text(json.dumps({**written, "global_head_dim": written["head_dim"]}))
        vocab = {str(i): i for i in range(config.vocab_size)}
        (out / "hf" / "tokenizer.json").write_text(json.dumps({"model": {"vocab": vocab}, "added_tokens": []}))
    import gguf
    from conversion import get_model_class

    cls = get_model_class(model.config.architectures[0])
    cls.no_mtp = arch not in WITH_MTP  # no multi-token-prediction layers (the converter's --no-mtp)
    converter = cls(out / "hf", gguf.LlamaFileType.ALL_F32, out / "model.gguf.partial", eager=True)
    converter.set_vocab = lambda: copy_vocabulary(converter.gguf_writer, fields)
    with torch.inference_mode():
        converter.write()
    (out / "model.gguf.partial").rename(out / "model.gguf")
    return out / "model.gguf"


def build_gemma3_vision(llama_cpp: Path, out: Path) -> Path:
    """Write a seeded random tiny Gemma 3 with a vision tower to out/hf (and its text config to out/hf-text), its text
    model's GGUF (F32) to out/model.gguf and its projector's to out/mmproj.gguf."""
    import re
    import shutil

    import gguf
    import torch
    import transformers
    from conversion import get_model_class
    from safetensors.torch import load_file, save_file

    fields = vocabulary(llama_cpp, "llama-spm")
    vocab = len(next(f for f in fields if f.name == "tokenizer.ggml.tokens").data)
    text = dict(**TINY, head_dim=16, sliding_window=64, vocab_size=vocab, max_position_embeddings=4096)
    text["layer_types"] = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    config = transformers.Gemma3Config(
        text_config=text,
        vision_config=dict(**VISION, vision_use_head=False),
        mm_tokens_per_image=IMAGE_ROWS,
        boi_token_index=vocab - 4,
        eoi_token_index=vocab - 3,
        image_token_index=vocab - 2,
    )
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).to(torch.float32)
    with torch.no_grad():  # larger weights than the default init (as build's): logits far from uniform
        for name, param in model.named_parameters():
            if param.dim() >= 2 and "vision_tower" not in name:
                param.normal_(0.0, 0.2)
            elif "soft_emb_norm" in name:
                param.normal_(0.0, 0.2)
    model.config.architectures = ["Gemma3ForConditionalGeneration"]
    model.save_pretrained(out / "hf")
    model.config.text_config.save_pretrained(out / "hf-text")
    half = dict(image_mean=[0.5] * 3, image_std=[0.5] * 3, image_seq_length=IMAGE_ROWS)  # Gemma 3's preprocessing
    (out / "hf" / "preprocessor_config.json").write_text(json.dumps(half))
    tokens = {str(i): i for i in range(vocab)}  # the converter trims the embedding to the tokenizer's size
    (out / "hf" / "tokenizer.json").write_text(json.dumps({"model": {"vocab": tokens}, "added_tokens": []}))
    # the projector's converter knows the tower's tensors by the published checkpoints' names (vision_model inside)
    shutil.copytree(out / "hf", out / "hf-mmproj", ignore=shutil.ignore_patterns("*.safetensors"))
    weights = load_file(out / "hf" / "model.safetensors")
    tower = re.compile(r"^vision_tower\.(?!vision_model\.)")
    renamed = {tower.sub("vision_tower.vision_model.", name): w for name, w in weights.items()}
    save_file(renamed, out / "hf-mmproj" / "model.safetensors", metadata={"format": "pt"})
    for name, mmproj in (("model.gguf", False), ("mmproj.gguf", True)):
        cls = get_model_class("Gemma3ForConditionalGeneration", mmproj=mmproj)
        folder = out / ("hf-mmproj" if mmproj else "hf")
        converter = cls(folder, gguf.LlamaFileType.ALL_F32, out / f"{name}.partial", eager=True)
        if not mmproj:
            converter.set_vocab = lambda converter=converter: copy_vocabulary(converter.gguf_writer, fields)
        with torch.inference_mode():
            converter.write()
        (out / f"{name}.partial").rename(out / name)
    return out / "model.gguf"


def image_features(folder: Path, pixels):
    """Transformers' Gemma 3 vision tower + projector on RGB uint8 pixels [height, width, 3] of the tower's own size
    (no resampling), normalized as Gemma 3's processor and llama.cpp's mtmd do ((x / 255 - 0.5) / 0.5): [rows, dim]."""
    import torch
    import transformers

    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    values = ((pixels.to(torch.float32) / 255.0 - 0.5) / 0.5).permute(2, 0, 1)[None]
    with torch.no_grad():
        out = model.model.get_image_features(pixel_values=values)
    out = getattr(out, "pooler_output", out)
    return (out[0] if isinstance(out, (tuple, list)) else out).reshape(-1, model.config.text_config.hidden_size)


def add_mtp_block(folder: Path, config) -> None:
    """Add a seeded MTP block to a saved Qwen3.5 model, named as Qwen3.5's checkpoints name it: fc over [normed
    embedding; normed hidden state] (the embedding's half near identity, the hidden state's of HIDDEN size), those
    two norms, one full-attention decoder layer (weights of WEAK size) and its final norm."""
    import torch
    from safetensors.torch import load_file, save_file

    weights = load_file(folder / "model.safetensors")
    full = config.layer_types.index("full_attention")
    prefix = f"model.layers.{full}."
    shapes = {
        f"mtp.layers.0.{name.removeprefix(prefix)}": w.shape for name, w in weights.items() if name.startswith(prefix)
    }
    hidden = config.hidden_size
    shapes |= {"mtp.fc.weight": (hidden, 2 * hidden)}
    shapes |= {f"mtp.{name}.weight": (hidden,) for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}
    generator = torch.Generator().manual_seed(1)
    for name, shape in sorted(shapes.items()):  # norms stored as offsets from 1, as Qwen3.5's
        weights[name] = torch.randn(shape, generator=generator) * (WEAK if len(shape) > 1 else 0.1)
    weights["mtp.fc.weight"][:, :hidden] += torch.eye(hidden)
    weights["mtp.fc.weight"][:, hidden:] *= HIDDEN / WEAK
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    written = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**written, "mtp_num_hidden_layers": 1}))


def mtp_reference(folder: Path, tokens: list[int], rows: int):
    """The MTP block's chain by transformers' modules, as llama.cpp's MTP driver runs it: position p takes token p and
    the model's final-normed hidden state at p - 1 (zeros at 0); after tokens' last, each step takes the previous
    step's argmax and the block's own normed output, attending causally. Returns the `rows` steps' logits."""
    import torch
    import transformers
    from safetensors.torch import load_file
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    config, weights = model.config, load_file(folder / "model.safetensors")
    layer = Qwen3_5DecoderLayer(config, config.layer_types.index("full_attention"))
    block = {k.removeprefix("mtp.layers.0."): v for k, v in weights.items() if k.startswith("mtp.layers.0.")}
    layer.load_state_dict(block)

    def norm(name: str) -> Qwen3_5RMSNorm:
        module = Qwen3_5RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        module.weight.data.copy_(weights[f"mtp.{name}.weight"])
        return module

    def forward(ids: list[int], states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        embedded = model.model.embed_tokens(torch.tensor(ids))
        joined = torch.cat([norm("pre_fc_norm_embedding")(embedded), norm("pre_fc_norm_hidden")(states)], dim=-1)
        x = (joined @ weights["mtp.fc.weight"].T)[None]
        positions = torch.arange(len(ids))
        rotary = model.model.rotary_emb(x, positions.view(1, 1, -1).expand(3, 1, -1))
        mask = torch.full((len(ids), len(ids)), float("-inf")).triu(1)[None, None]
        out = layer(x, position_embeddings=rotary, attention_mask=mask, position_ids=positions[None])
        normed = norm("norm")(out[0] if isinstance(out, tuple) else out)[0]
        return normed[-1], model.lm_head(normed[-1])

    with torch.no_grad():
        hidden = model(torch.tensor([tokens[:-1]]), output_hidden_states=True).hidden_states[-1][0]
        ids, states, chain = list(tokens), torch.cat([torch.zeros(1, config.hidden_size), hidden]), []
        for _ in range(rows):
            state, logits = forward(ids, states)
            chain.append(logits)
            ids.append(int(logits.argmax()))
            states = torch.cat([states, state[None]])
        return torch.stack(chain)


if __name__ == "__main__":
    if sys.argv[1] == "--mtp-reference":
        from safetensors.torch import save_file

        logits = mtp_reference(Path(sys.argv[2]), [int(t) for t in sys.argv[5:]], int(sys.argv[4]))
        save_file({"logits": logits.contiguous()}, sys.argv[3])
        sys.exit(0)
    if sys.argv[1] == "--image-features":
        from safetensors.torch import load_file, save_file

        features = image_features(Path(sys.argv[2]), load_file(sys.argv[3])["pixels"])
        save_file({"features": features.contiguous()}, sys.argv[4])
        sys.exit(0)
    source = Path(sys.argv[1])
    sys.path[:0] = [str(source), str(source / "gguf-py")]
    for name in sys.argv[3:]:
        if name == "gemma3-vision":
            build_gemma3_vision(source, Path(sys.argv[2]) / name)
        else:
            build(source, name, Path(sys.argv[2]) / name)
