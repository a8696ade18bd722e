"""Runs in .venv-vllm (vLLM's CPU build). load: for each job, vLLM reads the speculative config that `dflash export
--to vllm` printed, with the target folder, picks its model class and loads the exported drafter's weights; the
results (or each job's error) go to OUT/vllm.json. generate: vLLM decodes each prompt greedily with the pair
(DFlash speculative decoding), and OUT/drafted.json gets each one's tokens, drafting steps and accepted drafts.

    .venv-vllm/bin/python tests/vllm_reference.py load JOBS.json OUT
JOBS.json: [{"name", "target", "speculative_config"}]
    .venv-vllm/bin/python tests/vllm_reference.py generate JOB.json OUT
JOB.json: {"target", "speculative_config", "prompts": [[ids]], "max_tokens"}"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache: vLLM's CPU default reserves most of RAM

import torch  # noqa: E402 (vLLM reads its environment at import)
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


def spec_counts(llm) -> tuple[int, int]:
    """vLLM's running totals: drafting steps and accepted draft tokens."""
    found = {metric.name: getattr(metric, "value", 0) for metric in llm.get_metrics()}
    return found.get("vllm:spec_decode_num_drafts", 0), found.get("vllm:spec_decode_num_accepted_tokens", 0)


def generate(job: dict, out: Path) -> None:
    """Each prompt decoded alone (so vLLM's counters are its own), greedy, max_tokens new tokens (past any end)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    target = job["target"]
    llm = LLM(
        model=target,
        tokenizer=target,
        dtype="float32",
        speculative_config=job["speculative_config"],
        max_model_len=512,
        enforce_eager=True,
        disable_log_stats=False,
    )
    greedy, results = SamplingParams(max_tokens=job["max_tokens"], temperature=0, ignore_eos=True), []
    for prompt in job["prompts"]:
        before = spec_counts(llm)
        made = llm.generate([TokensPrompt(prompt_token_ids=prompt)], greedy, use_tqdm=False)[0].outputs[0].token_ids
        after = spec_counts(llm)
        results.append({"token_ids": list(made), "drafts": after[0] - before[0], "accepted": after[1] - before[1]})
    (out / "drafted.json").write_text(json.dumps(results))


def main() -> None:
    mode, job_file, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    if mode == "generate":
        generate(json.loads(job_file.read_text()), out)
        return
    jobs = json.loads(job_file.read_text())
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


if __name__ == "__main__":  # vLLM's engine starts its own processes, which import this file again
    main()
