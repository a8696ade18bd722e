"""Prompt corpus for self-distillation: text files become token windows, JSONL lines become prompts or chats."""

from __future__ import annotations

import random
from pathlib import Path

from ..errors import DFlashError
from ..tokenizer import TextTokenizer
from ..weights import read_jsonl

TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".c", ".h", ".js", ".ts", ".rs", ".go", ".java", ".json", ".toml"}


def corpus_files(paths: list[Path]) -> list[Path]:
    """Every readable corpus file under the given files and folders, in a stable order."""
    files: list[Path] = []
    for path in paths:
        if not path.exists():
            raise DFlashError(f"Corpus path {path} does not exist.")
        if path.is_dir():
            files.extend(p for p in sorted(path.rglob("*")) if p.is_file() and p.suffix in TEXT_SUFFIXES | {".jsonl"})
        else:
            files.append(path)
    return files


def _jsonl_prompts(path: Path, tokenizer: TextTokenizer) -> tuple[list[list[int]], list[str]]:
    """Chat and prompt lines become prompts; text lines become documents."""
    prompts, documents = [], []
    for _, record in read_jsonl(path):
        if isinstance(record.get("messages"), list):
            messages = record["messages"]
            while messages and messages[-1].get("role") == "assistant":
                messages = messages[:-1]  # the target writes the answer itself
            if messages:
                prompts.append(tokenizer.encode_chat(messages, add_generation_prompt=True))
        elif isinstance(record.get("prompt"), str) and record["prompt"]:
            prompts.append(tokenizer.encode(record["prompt"]))
        elif isinstance(record.get("text"), str):
            documents.append(record["text"])
    return prompts, documents


def load_prompts(paths: list[Path], tokenizer: TextTokenizer | None, window: int, seed: int) -> list[list[int]]:
    """Prompts as token ids: chats/prompts from JSONL, plus random `window`-token windows of text documents."""
    if tokenizer is None:
        raise DFlashError("The target has no tokenizer.json, which training needs to read a text corpus.")
    prompts: list[list[int]] = []
    documents: list[str] = []
    for path in corpus_files(paths):
        if path.suffix == ".jsonl":
            more_prompts, more_documents = _jsonl_prompts(path, tokenizer)
            prompts += more_prompts
            documents += more_documents
        else:
            documents.append(path.read_text(errors="replace"))
    rng = random.Random(seed)
    begin = tokenizer.encode("", add_special_tokens=True)  # what the target sees first at inference (BOS, if any)
    for document in documents:
        ids = tokenizer.encode(document, add_special_tokens=False)
        if len(ids) < window + 8:
            continue
        for _ in range(max(1, len(ids) // (4 * window))):
            start = rng.randrange(len(ids) - window)
            prompts.append(begin + ids[start : start + window])
    prompts = [p for p in prompts if p]
    if not prompts:
        raise DFlashError(f"The corpus has no usable text (need documents of at least {window + 8} tokens or prompts).")
    rng.shuffle(prompts)
    return prompts
