"""Corpus for the tiny DFlash target model: the Python standard library sources.

Training documents are the stdlib ``*.py`` files of the running interpreter (tests, idlelib,
site-packages and files over 300 KB excluded), minus the ``HELD_OUT_MODULES``, whose sources are
used only for evaluation prompts. Everything here is deterministic.

Run ``.venv/bin/python -m models.tiny.recipe.corpus`` from the repository root to write
``models/tiny/heldout_prompts.jsonl``.
"""

from __future__ import annotations

import ast
import functools
import json
import sysconfig
import textwrap
from pathlib import Path

# Stdlib modules (plain .py files) never used for training; their code is the evaluation set.
HELD_OUT_MODULES: tuple[str, ...] = (
    "textwrap",
    "fractions",
    "heapq",
    "bisect",
    "shlex",
    "colorsys",
    "statistics",
    "difflib",
    "calendar",
    "string",
)

SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|user|>", "<|assistant|>", "<|end|>", "<|mask|>")
MAX_FILE_BYTES = 300_000
MAX_RESPONSE_CHARS = 600
SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "__pycache__", "lib2to3/tests"}
PROMPTS_PATH = Path(__file__).resolve().parents[1] / "heldout_prompts.jsonl"
DOC_DIR = Path("/usr/share/doc/python3.11")


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _module_name(rel: Path) -> str:
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _skipped(rel: Path) -> bool:
    dirs = rel.parts[:-1]
    if any(part in SKIP_DIRS or part.startswith("test") for part in dirs):
        return True
    if rel.parts[0].startswith("config-"):  # build-configuration helpers, not library code
        return True
    return False


def _clean(text: str) -> str | None:
    """Drop texts that would collide with the special tokens (none in practice)."""
    if any(token in text for token in SPECIAL_TOKENS):
        return None
    return text


@functools.lru_cache(maxsize=1)
def _stdlib_files() -> tuple[tuple[str, str, str], ...]:
    """(relative path, module name, text) of every usable stdlib file, sorted by path."""
    root = stdlib_root()
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if _skipped(rel) or path.stat().st_size > MAX_FILE_BYTES:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        text = _clean(text)
        if text is None or not text.strip():
            continue
        out.append((rel.as_posix(), _module_name(rel), text))
    return tuple(out)


def _is_held_out(module: str) -> bool:
    return module.split(".")[0] in HELD_OUT_MODULES


def _doc_files() -> list[str]:
    """reST docs from Debian's python3.11-doc, when installed (usually absent)."""
    texts = []
    if DOC_DIR.is_dir():
        for path in sorted(DOC_DIR.rglob("*.txt")) + sorted(DOC_DIR.rglob("*.rst")):
            if any(name in path.name for name in HELD_OUT_MODULES):
                continue
            try:
                text = _clean(path.read_text(encoding="utf-8"))
            except (UnicodeDecodeError, OSError):
                continue
            if text and path.stat().st_size <= MAX_FILE_BYTES:
                texts.append(text)
    return texts


def training_files() -> list[tuple[str, str, str]]:
    """(relative path, module name, text) of the training files, held-out modules excluded."""
    return [item for item in _stdlib_files() if not _is_held_out(item[1])]


def training_documents() -> list[str]:
    """All training texts in a fixed order (stdlib sources, then any reST docs)."""
    return [text for _, _, text in training_files()] + _doc_files()


def heldout_files() -> list[tuple[str, str, str]]:
    files = [item for item in _stdlib_files() if _is_held_out(item[1])]
    order = {name: i for i, name in enumerate(HELD_OUT_MODULES)}
    return sorted(files, key=lambda item: (order[item[1].split(".")[0]], item[0]))


def _functions(tree: ast.AST):
    """Top-level functions and methods of top-level classes, in source order, with their class."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield None, node
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield node, item


def _source(text: str, node: ast.AST) -> str | None:
    lines = text.splitlines(keepends=True)
    start = node.decorator_list[0].lineno if getattr(node, "decorator_list", None) else node.lineno
    segment = "".join(lines[start - 1 : node.end_lineno])
    return textwrap.dedent(segment)


def _prompt_from_function(source: str, node: ast.FunctionDef) -> str | None:
    """Signature + docstring (start) + first body line, cut at a line end, 100-400 chars."""
    lines = source.splitlines(keepends=True)
    first = node.lineno - (node.decorator_list[0].lineno if node.decorator_list else node.lineno)
    doc_end = node.body[0].end_lineno - node.lineno + first if len(node.body) > 1 else None
    if doc_end is None:
        return None
    # Up to the end of the docstring plus one line of code.
    wanted = "".join(lines[: doc_end + 2])
    if len(wanted) <= 400 and doc_end + 2 < len(lines):
        prompt = wanted
    else:
        prompt = ""
        for line in lines:
            if len(prompt) + len(line) > 400:
                break
            prompt += line
    # No trailing newline: byte-level BPE merges "\n" with the next line's indentation, so a prompt
    # ending in a bare "\n" would force an unusual token boundary (the model then starts a new
    # top-level block); ending at the end of a code line lets "\n" + indent be predicted naturally.
    prompt = prompt.rstrip("\n")
    if len(prompt) < 100 or len(prompt) >= len(source) - 20:
        return None
    return prompt


def heldout_prompts(count: int) -> list[str]:
    """Deterministic prompts from the held-out modules, round-robin over modules."""
    per_module: dict[str, list[str]] = {name: [] for name in HELD_OUT_MODULES}
    for _, module, text in heldout_files():
        tree = ast.parse(text)
        for _, node in _functions(tree):
            if ast.get_docstring(node) is None:
                continue
            source = _source(text, node)
            prompt = _prompt_from_function(source, node) if source else None
            if prompt:
                per_module[module.split(".")[0]].append(prompt)
    prompts: list[str] = []
    depth = 0
    while len(prompts) < count and any(depth < len(v) for v in per_module.values()):
        for name in HELD_OUT_MODULES:
            items = per_module[name]
            # Spread picks through each module instead of taking only its first functions.
            if depth < len(items):
                step = max(1, len(items) // 3)
                order = items[::step] + [p for i, p in enumerate(items) if i % step]
                prompts.append(order[depth])
                if len(prompts) == count:
                    break
        depth += 1
    return prompts


def _first_line(doc: str) -> str:
    para = doc.strip().split("\n\n")[0]
    return " ".join(para.split())


def _trim_doc(doc: str) -> str:
    doc = doc.strip()
    if len(doc) <= MAX_RESPONSE_CHARS:
        return doc
    out = ""
    for para in doc.split("\n\n"):
        if len(out) + len(para) + 2 > MAX_RESPONSE_CHARS:
            break
        out = f"{out}\n\n{para}" if out else para
    return out


def _args(node: ast.FunctionDef) -> str:
    try:
        return ast.unparse(node.args)
    except Exception:  # pragma: no cover - unparse handles every 3.11 signature
        return "..."


@functools.lru_cache(maxsize=1)
def _chat_pairs() -> tuple[tuple[str, str], ...]:
    pairs: list[tuple[str, str]] = []
    for _, module, text in training_files():
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        for cls, node in _functions(tree):
            if node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            if not doc or len(doc) < 20:
                continue
            summary = _first_line(doc)
            if not (10 <= len(summary) <= 200):
                continue
            qual = f"{cls.name}.{node.name}" if cls else node.name
            if cls is not None and cls.name.startswith("_"):
                continue
            args = _args(node)
            if cls is not None and args.startswith("self"):
                args = args[len("self") :].lstrip(", ")
            source = _source(text, node)
            if source and len(source) <= MAX_RESPONSE_CHARS and cls is None:
                request = summary[0].lower() + summary[1:] if summary[:2] != summary[:2].upper() else summary
                pairs.append((f"Write a Python function `{node.name}({args})` that {request}", source.rstrip() + "\n"))
            explanation = _trim_doc(doc)
            if explanation:
                pairs.append((f"Explain what `{module}.{qual}` does.", explanation))
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= 20:
                    explanation = _trim_doc(doc)
                    if explanation:
                        pairs.append((f"What is the class `{module}.{node.name}` for?", explanation))
        module_doc = ast.get_docstring(tree)
        if module_doc and len(module_doc) >= 20 and not module.split(".")[-1].startswith("_"):
            explanation = _trim_doc(module_doc)
            if explanation:
                pairs.append((f"What does the Python module `{module}` do?", explanation))
    return tuple((u, r) for u, r in pairs if _clean(u + r) is not None)


def chat_pairs() -> list[tuple[str, str]]:
    """Instruction/response pairs mined from the training files (never the held-out modules)."""
    return list(_chat_pairs())


def main() -> None:
    prompts = heldout_prompts(20)
    PROMPTS_PATH.parent.mkdir(parents=True, exist_ok=True)
    with PROMPTS_PATH.open("w", encoding="utf-8") as handle:
        for prompt in prompts:
            handle.write(json.dumps({"prompt": prompt}) + "\n")
    docs = training_documents()
    pairs = chat_pairs()
    print(f"{len(docs)} training documents, {sum(map(len, docs)) / 1e6:.1f} M chars")
    print(f"{len(pairs)} chat pairs, {sum(len(u) + len(r) for u, r in pairs) / 1e6:.1f} M chars")
    print(f"wrote {len(prompts)} prompts to {PROMPTS_PATH}")


if __name__ == "__main__":
    main()
