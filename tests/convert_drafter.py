"""A drafter folder written to GGUF by llama.cpp's own converter (its DFlashDraftModel class), as ggml-org's
dflash-*.gguf files are: the vocabulary comes from the target's GGUF, in place of the converter's --target-model-dir
tokenizer reading (tiny_archs.copy_vocabulary).

Runs in the oracle environment with llama.cpp's source tree (converter and gguf-py) on the path:
  python tests/convert_drafter.py LLAMA_CPP_DIR DRAFTER_FOLDER TARGET_GGUF OUT_GGUF
"""

from __future__ import annotations

import sys
from pathlib import Path


def convert(drafter: Path, target_gguf: Path, out: Path) -> Path:
    """Write drafter (config.json + model.safetensors) as an F32 `dflash` GGUF at out, the target's vocabulary in it."""
    import gguf
    import torch
    from conversion import get_model_class
    from tiny_archs import copy_vocabulary

    fields = [f for key, f in gguf.GGUFReader(target_gguf).fields.items() if key.startswith("tokenizer.")]
    converter = get_model_class("DFlashDraftModel")(drafter, gguf.LlamaFileType.ALL_F32, out.with_suffix(".partial"))
    mask_token_id = converter.hparams["dflash_config"]["mask_token_id"]

    def set_vocab() -> None:
        copy_vocabulary(converter.gguf_writer, [f for f in fields if f.name != "tokenizer.ggml.mask_token_id"])
        converter.gguf_writer.add_mask_token_id(mask_token_id)

    converter.set_vocab = set_vocab
    with torch.inference_mode():
        converter.write()
    out.with_suffix(".partial").rename(out)
    return out


if __name__ == "__main__":
    source = Path(sys.argv[1])
    sys.path[:0] = [str(source), str(source / "gguf-py"), str(Path(__file__).parent)]
    convert(Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]))
