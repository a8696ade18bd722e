"""The package's layers, lowest first, written down once: a module imports only from its own layer or lower ones,
and no chain of imports (top-level, lazy or for type checking) comes back to where it started."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SOURCES = {"dflash_local": REPO / "dflash_local", "dflash_local.kernels": REPO / "kernels"}

LAYERS = (
    (  # gguf: init
        *("errors", "atomic", "paths", "dimensions", "shapes", "llama_lib", "llama_context", "lanes", "vulkan_probe"),
        *("devices", "tap_probe", "defaults", "kernels", "gguf", "kv_cache"),
    ),
    (  # files
        *("local_models", "hub", "hub_access", "hub_pull", "downloads", "catalog", "memory_estimate", "prompt_sets"),
        *("weights", "gguf.file"),
    ),
    (  # blocks
        *("chat_template", "offload", "runtime", "layers", "quant", "cuda_graphs", "gguf.shape"),
        *("target_config",),
        *("gguf.tensors",),
    ),
    ("targets", "tokenizer", "gguf.tokenizer", "grammar", "sampling", "reasoning", "reply"),  # targets, vocabularies,
    # replies, and turning scores into tokens (the grammar's processor among them)
    ("drafters", "gguf.convert"),  # what builds on a target
    ("block_policy", "prompt_cache", "session", "decode"),  # the decode loop
    (  # fronts
        *("generation", "vision", "handoff", "export", "doctor", "chat", "bench", "peer", "server", "model_list"),
        *("train",),
        *("cli", "__main__"),
    ),
)


def modules() -> dict[str, Path]:
    """Every module of the package (kernels/ as dflash_local.kernels), by dotted name."""
    found = {}
    for package, folder in SOURCES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            name = ".".join((package, *parts)).removesuffix(".__init__")
            found[name] = path
    return found


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules this one imports anywhere in its body (a package stands for its __init__)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            targets = [f"{module}.{alias.name}" for alias in node.names] + [module]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
                break
    return found


def layer_of(name: str) -> int | None:
    """The layer of the longest entry that names the module or a package above it."""
    short = name.removeprefix("dflash_local").removeprefix(".")
    matches = [
        (len(entry), index)
        for index, layer in enumerate(LAYERS)
        for entry in layer
        if short == entry or short.startswith(f"{entry}.")
    ]
    return max(matches)[1] if matches else None


def graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imports(name, path, set(found)) for name, path in found.items() if name != "dflash_local"}


def test_every_module_has_a_layer():
    unplaced = [name for name in graph() if layer_of(name) is None]
    assert not unplaced, "\n".join(unplaced)


def test_no_module_imports_a_higher_layer():
    upward = [
        f"{name} (layer {layer_of(name)}) imports {target} (layer {layer_of(target)})"
        for name, targets in graph().items()
        for target in sorted(targets)
        if target != "dflash_local" and None not in (layer_of(name), layer_of(target))
        if layer_of(target) > layer_of(name)
    ]
    assert not upward, "\n".join(upward)


def test_no_import_cycle():
    edges, cycles, done = graph(), [], set()

    def visit(name: str, stack: list[str]) -> None:
        if name in stack:
            cycles.append(" -> ".join(stack[stack.index(name) :] + [name]))
            return
        if name in done:
            return
        for target in sorted(edges.get(name, ())):
            visit(target, [*stack, name])
        done.add(name)

    for name in sorted(edges):
        visit(name, [])
    assert not cycles, "\n".join(cycles)


def folder_of(name: str) -> str | None:
    """The package folder a module sits in below dflash_local (None: a module of dflash_local itself)."""
    parts = name.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and (REPO / "dflash_local" / parts[1]).is_dir()) else None


def test_no_import_cycle_between_folders():
    """Folders depend one way (imports for type checking included): no chain of folders comes back to its start."""
    edges: dict[str, set[str]] = {}
    for name, targets in graph().items():
        for target in targets:
            pair = folder_of(name), folder_of(target)
            if None not in pair and pair[0] != pair[1]:
                edges.setdefault(pair[0], set()).add(pair[1])
    cycles = []

    def visit(folder: str, stack: list[str]) -> None:
        if folder in stack:
            cycles.append(" -> ".join(stack[stack.index(folder) :] + [folder]))
            return
        for target in sorted(edges.get(folder, ())):
            visit(target, [*stack, folder])

    for folder in sorted(edges):
        visit(folder, [])
    assert not cycles, "\n".join(cycles)


def test_tools_import_nothing_from_tests():
    """tools/ runs in a user's venv (CI's check of an install) where tests/ is no package: it stands on its own."""
    found = []
    for path in sorted((REPO / "tools").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            found += [f"{path.name}: {name}" for name in names if name.partition(".")[0] in ("tests", "conftest")]
    assert not found, "\n".join(found)


def test_modules_and_functions_stay_readable():
    """No module of the package over 450 lines and no function over 70 (docs/architecture.md's bar)."""
    long = []
    for name, path in modules().items():
        text = path.read_text()
        if text.count("\n") > 450:
            long.append(f"{name}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 70:
                long.append(f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not long, "\n".join(long)
