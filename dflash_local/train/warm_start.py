"""Where a drafter's training starts: the target's own last layers (`--init target`) or an existing drafter
(`--init DRAFTER`), as tensors named like the drafter's; fc always takes the target's raw features."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..drafters.config import DrafterConfig
from ..drafters.torch_drafter import DFlashModel
from ..errors import DFlashError
from ..gguf.shape import LAYER_TENSORS
from ..target_config import TargetConfig
from ..targets.torch_llama import LlamaModel
from ..weights import read_config, read_weights

# target layer number -> its tensors under a drafter layer's names (those it has); -1: {"norm.weight": final norm}
LayerReader = Callable[[int], dict[str, torch.Tensor]]


@dataclass
class WarmStart:
    """What a warm start copied: drafter layer i from target layer target_layers[i], and how many tensors."""

    source: str
    target_layers: list[int]
    tensors: int

    @property
    def layers(self) -> str:
        """Which target layer each drafter layer came from, in words ('' for a drafter)."""
        pairs = ", ".join(f"{i} <- {n}" for i, n in enumerate(self.target_layers))
        return f"(drafter layer <- target layer: {pairs})" if pairs else ""


def torch_layer_reader(model: LlamaModel) -> LayerReader:
    """Layer tensors of a torch target."""
    state = model.state_dict()

    def read(number: int) -> dict[str, torch.Tensor]:
        if number < 0:
            return {"norm.weight": state["model.norm.weight"]}
        prefix = f"model.layers.{number}."
        return {name[len(prefix) :]: t for name, t in state.items() if name.startswith(prefix)}

    return read


def gguf_layer_reader(tensors: dict, cfg: TargetConfig, matrix: Callable[[object], torch.Tensor]) -> LayerReader:
    """Layer tensors of a GGUF target (matrix dequantizes one GGUF tensor); llama's converter permutes Q and K rows for
    its rotary layout, which is undone here."""

    def unpermute(weight: torch.Tensor, heads: int) -> torch.Tensor:
        rows, width = weight.shape
        return weight.view(heads, rows // heads // 2, 2, width).transpose(1, 2).reshape(rows, width)

    def read(number: int) -> dict[str, torch.Tensor]:
        if number < 0:
            return {"norm.weight": matrix(tensors["output_norm.weight"])}
        out = {}
        for name, gguf_name in LAYER_TENSORS.items():
            found = tensors.get(f"blk.{number}.{gguf_name}")
            if found is not None:
                out[name] = matrix(found)
        if cfg.model_type == "llama":
            out["self_attn.q_proj.weight"] = unpermute(out["self_attn.q_proj.weight"], cfg.dims.heads)
            out["self_attn.k_proj.weight"] = unpermute(out["self_attn.k_proj.weight"], cfg.dims.kv_heads)
        return out

    return read


def from_target(read: LayerReader, config: dict) -> tuple[dict[str, torch.Tensor], WarmStart]:
    """Drafter layer i from the target's layer N - L + i (those of its tensors whose shapes match), the final norm
    from the target's, hidden_norm from the first copied layer's input norm and fc the identity on the deepest tapped
    layer's features: the first drafter layer's context K/V are then the target's next layer's, where that deepest
    layer is the one just before it."""
    cfg = DrafterConfig.from_dict(config, Path("<new drafter>"))
    numbers = list(range(config["num_target_layers"] - cfg.dims.layers, config["num_target_layers"]))
    hidden = cfg.dims.hidden
    state: dict[str, torch.Tensor] = {}
    for index, number in enumerate(numbers):
        state.update({f"layers.{index}.{name}": t for name, t in read(number).items()})
    state.update(read(-1))
    first = state.get("layers.0.input_layernorm.weight")
    if first is not None:
        state["hidden_norm.weight"] = first
    fc = torch.zeros(hidden, hidden * len(cfg.target_layer_ids))
    deepest = cfg.target_layer_ids.index(max(cfg.target_layer_ids))
    fc[:, deepest * hidden : (deepest + 1) * hidden] = torch.eye(hidden)
    state["fc.weight"] = fc
    shapes = _shapes(config)
    state = {name: t.float() for name, t in state.items() if name in shapes and tuple(t.shape) == shapes[name]}
    return state, WarmStart("target", numbers, len(state))


def _shapes(config: dict) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        model = DFlashModel(DrafterConfig.from_dict(config, Path("<new drafter>")))
    return {name: tuple(p.shape) for name, p in model.state_dict().items()}


def drafter_config(folder: Path) -> dict:
    """An existing drafter's config.json, checked."""
    config = read_config(folder)
    DrafterConfig.from_dict(config, folder)
    return config


def check_drafter_fits(folder: Path, config: dict, target: TargetConfig) -> None:
    """One sentence unless the drafter in folder can read this target's features and vocabulary."""
    cfg = DrafterConfig.from_dict(config, folder)
    reason = None
    if cfg.dims.hidden != target.dims.hidden:
        reason = f"its hidden size is {cfg.dims.hidden}, the target's {target.dims.hidden}"
    elif cfg.dims.vocab and cfg.dims.vocab != target.dims.vocab:
        reason = f"its vocabulary has {cfg.dims.vocab} ids, the target's {target.dims.vocab}"
    elif config.get("num_target_layers", target.dims.layers) != target.dims.layers:
        reason = f"it was made for a target of {config['num_target_layers']} layers, this one has {target.dims.layers}"
    elif any(not 0 <= i < target.dims.layers for i in cfg.target_layer_ids):
        reason = f"it reads target layers {cfg.target_layer_ids}, this target has {target.dims.layers}"
    if reason:
        raise DFlashError(f"The drafter in {folder} does not fit this target: {reason}.")


def from_drafter(folder: Path, config: dict) -> tuple[dict[str, torch.Tensor], torch.Tensor | None, WarmStart]:
    """An existing drafter's tensors (fp32), its draft vocabulary (d2t) if it has one, and what was read."""
    shapes = _shapes(config)
    state = {name: t for name, t in read_weights(folder, torch.float32) if name in shapes}
    for name, shape in shapes.items():
        if name not in state:
            raise DFlashError(f"{folder} lacks the drafter tensor {name}.")
        if tuple(state[name].shape) != shape:
            raise DFlashError(f"{folder}: drafter tensor {name} has shape {tuple(state[name].shape)}, not {shape}.")
    d2t = state.pop("d2t", None)
    return state, (None if d2t is None else d2t.long()), WarmStart(str(folder), [], len(state))
