"""Benchmark prompt sets from Hugging Face datasets by name (gsm8k, humaneval, mt-bench), cached as JSONL."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .atomic import write_text_atomic
from .errors import DFlashError
from .hub_access import endpoint, hub_errors, with_retries
from .paths import cache_dir, state_dir


@dataclass(frozen=True)
class PromptSet:
    """One file of a dataset repo and how its rows become chat or plain-text prompts."""

    repo: str
    filename: str
    field: str
    chat: bool  # True: the field is a user message; False: raw text to continue (code completion)


PROMPT_SETS = {
    "gsm8k": PromptSet("openai/gsm8k", "main/test-00000-of-00001.parquet", "question", chat=True),
    "humaneval": PromptSet("openai/openai_humaneval", "openai_humaneval/test-00000-of-00001.parquet", "prompt", False),
    "mt-bench": PromptSet("HuggingFaceH4/mt_bench_prompts", "raw/question.jsonl", "turns", chat=True),
}


def prompt_file(name: str, token: str | None = None, offline: bool = False) -> Path:
    """A JSONL prompt file for a dataset name, downloaded (or taken from the cache when offline) and converted.

    The dataset's info is asked for first, under pull's retry policy (3 s): hf_hub_download alone retries an
    unreachable Hub for 23 s, logging each try."""
    from huggingface_hub import HfApi, constants, errors, hf_hub_download

    spec = PROMPT_SETS[name]
    where = {"repo_type": "dataset", "cache_dir": cache_dir(), "endpoint": endpoint(), "token": token}
    if offline:
        try:
            path = hf_hub_download(spec.repo, spec.filename, local_files_only=True, **where)
        except errors.LocalEntryNotFoundError:
            raise DFlashError(f"The {name} prompts are not downloaded and --offline is set.") from None
    else:
        api, timeout = HfApi(endpoint=endpoint()), constants.HF_HUB_DOWNLOAD_TIMEOUT
        with hub_errors(spec.repo, token):
            with_retries(lambda: api.dataset_info(spec.repo, token=token, timeout=timeout))
            path = hf_hub_download(spec.repo, spec.filename, **where)
    rows = _rows(Path(path), spec.field)
    lines = []
    for value in rows:
        text = value[0] if isinstance(value, list) else value  # mt-bench: the first turn
        record = {"messages": [{"role": "user", "content": text}]} if spec.chat else {"prompt": text}
        lines.append(json.dumps(record) + "\n")
    out = state_dir() / "prompts" / f"{name}.jsonl"
    write_text_atomic(out, "".join(lines))
    return out


def _rows(path: Path, field: str) -> list:
    """The field's value in every row of a .parquet or .jsonl file."""
    try:
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            return pq.read_table(path, columns=[field]).column(field).to_pylist()
        return [json.loads(line)[field] for line in path.read_text().splitlines() if line.strip()]
    except Exception as exc:  # pyarrow and json raise many types for a bad file
        raise DFlashError(f"{path} is not a readable prompt set ({exc}).") from None
