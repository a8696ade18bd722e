"""Runs in .venv-vllm (vLLM's CPU build): for each job, vLLM reads the speculative config that `dflash export --to
vllm` printed, with the target folder, picks its model class and loads the exported drafter's weights; the results
(or each job's error) go to OUT/vllm.json.

    .venv-vllm/bin/python tests/vllm_reference.py JOBS.json OUT
JOBS.json: [{"name", "target", "speculative_config"}]."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import torch
from vllm.config import (
    DeviceConfig,
    LoadConfig,
    ModelConfig,
    ParallelConfig,
    SpeculativeConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.model_executor.model_loader import get_model
from vllm.model_executor.models.registry import ModelRegistry

torch.accelerator.empty_cache = lambda: None  # vLLM's loader calls it after loading; this machine has no accelerator


def load(target: str, speculative: dict) -> dict:
    """vLLM's reading of the pair and the drafter model it builds: method, draft count, class, dflash_config."""
    target_config = ModelConfig(model=target, tokenizer=target, dtype="float32", skip_tokenizer_init=True)
    spec = SpeculativeConfig(**speculative, target_model_config=target_config, target_parallel_config=ParallelConfig())
    draft = spec.draft_model_config
    config = VllmConfig(
        model_config=target_config, speculative_config=spec, device_config=DeviceConfig("cpu"), load_config=LoadConfig()
    )
    with set_current_vllm_config(config):
        model = get_model(vllm_config=config, model_config=draft)
    cls, _ = ModelRegistry.resolve_model_cls(draft.architectures, draft)
    dflash = dict(getattr(draft.hf_config, "dflash_config", None) or {})
    return {
        "method": spec.method,
        "num_speculative_tokens": spec.num_speculative_tokens,
        "class": cls.__name__,
        "built": type(model).__name__,
        "mask_token_id": dflash.get("mask_token_id"),
        "target_layer_ids": dflash.get("target_layer_ids"),
        "parameters": sorted(name for name, _ in model.named_parameters()),
    }


def main() -> None:
    jobs, out = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    with socket.socket() as probe:  # a free port for the one-process group vLLM's layers ask for
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, backend="gloo")
        initialize_model_parallel(1, 1)
    results = {}
    for job in jobs:
        try:
            results[job["name"]] = load(job["target"], job["speculative_config"])
        except Exception as exc:  # noqa: BLE001 (the job's failure is its result)
            results[job["name"]] = {"error": f"{type(exc).__name__}: {exc}"}
    (out / "vllm.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
