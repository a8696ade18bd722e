"""vLLM's `speculators` (0.9.0) as an independent reference for `dflash export`: each exported (z-lab layout) drafter
goes through speculators' own DFlash converter into its DFlashDraftModel, which drafts one block on the target's
hidden states, the target features chosen by its config (speculators' layer ids, hidden_states[id]).

Runs in the oracle environment, once for many drafters:
  python tests/speculators_reference.py JOBS.json OUT_DIR
JOBS.json: [{"target": HF folder, "ids": [...], "start": S, "drafters": {name: exported folder}}]. Writes
OUT_DIR/target.{j}.safetensors (the job's hidden states, hidden.{i}: embeddings, then each layer's output),
OUT_DIR/{name}.safetensors (logits of block rows 1..B-1 for the block [ids[S], MASK...] at S over the context
0..S-1) and OUT_DIR/results.json ({name: "ok" or the error speculators raised}).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from speculators.convert.dflash.converter import DFlashConverter
from speculators.models.dflash import DFlashDraftModel
from transformers import AutoModelForCausalLM


def hidden_states(target: str, ids: list[int]) -> list[torch.Tensor]:
    """The transformers target's hidden states for ids: embeddings, then each decoder layer's output, [T, H]."""
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    with torch.no_grad():
        return [h[0] for h in model(torch.tensor([ids]), output_hidden_states=True).hidden_states]


def load(exported: str, target: str, scratch: Path) -> DFlashDraftModel:
    """The exported drafter through speculators' converter, in float32 with the verifier's embedding and head, its
    attention eager (no mask: the block attends to the whole context and to itself, as DFlash drafts)."""
    converted = scratch / Path(exported).name
    DFlashConverter().convert(exported, converted, base_model=target, validate=False)
    model = DFlashDraftModel.from_pretrained(str(converted)).float().eval()
    model.load_verifier_weights()  # again in float32: the converter saved the verifier's embedding and head as bf16
    model.config.transformer_layer_config._attn_implementation = "eager"
    return model


def draft(model: DFlashDraftModel, states: list[torch.Tensor], ids: list[int], start: int) -> torch.Tensor:
    """The drafter's logits for block rows 1..B-1 of [ids[start], MASK x B-1] at positions start.., its context the
    target features of positions 0..start-1."""
    features = torch.cat([states[i][:start] for i in model.target_layer_ids], dim=-1)[None]
    block = torch.full((1, model.block_size), model.mask_token_id)
    block[0, 0] = ids[start]
    with torch.no_grad():
        context = model.hidden_norm(model.fc(features))
        x = model.embed_tokens(block)
        positions = torch.arange(start + model.block_size)[None]
        rope = model.rotary_emb(x, positions)
        for layer in model.layers:
            x = layer(hidden_states=x, target_hidden=context, attention_mask=None, position_embeddings=rope)
        return model.lm_head(model.norm(x))[0, 1:]


def main() -> None:
    jobs, out = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        for index, job in enumerate(jobs):
            states = hidden_states(job["target"], job["ids"])
            save_file(
                {f"hidden.{i}": h.contiguous() for i, h in enumerate(states)}, out / f"target.{index}.safetensors"
            )
            for name, exported in job["drafters"].items():
                try:
                    model = load(exported, job["target"], Path(scratch))
                    logits = draft(model, states, job["ids"], job["start"])
                except (ValueError, KeyError, RuntimeError) as exc:
                    results[name] = f"{type(exc).__name__}: {exc}"
                    continue
                save_file({"logits": logits.contiguous()}, out / f"{name}.safetensors")
                results[name] = "ok"
    (out / "results.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
