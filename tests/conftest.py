"""Session fixtures: tiny random-weight targets and drafters written to disk once per test run.

Also: a skip because something `./install.sh --dev` installs is missing is a failure, never a silent skip.
"""

from __future__ import annotations

import ast
import os
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ["TRITON_INTERPRET"] = "1"  # the Triton kernels run on the CPU: read when a kernel is defined, so before
# any test module imports one (test_kernels_compile starts its compiler without it)

from tiny_models import make_drafter, make_target  # noqa: E402

# llama-cpp-python loads its library on first import: through dflash's module, as the CLI does (the batch-invariant
# libllama install.sh builds, and dflash's ggml settings), before any test module imports llama_cpp itself.
import dflash_local.llama_lib  # noqa: E402, F401


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="session")
def llama_target(tiny_dir) -> Path:
    """Llama 3.x shape: llama3 RoPE scaling, GQA, untied head."""
    return make_target(tiny_dir / "llama", kind="llama", vocab_size=64, seed=0)


@pytest.fixture(scope="session")
def qwen3_target(tiny_dir) -> Path:
    """Qwen3 shape: q/k norms, head_dim != hidden/heads, tied embeddings."""
    return make_target(tiny_dir / "qwen3", kind="qwen3", vocab_size=48, seed=2, tied=True)


@pytest.fixture(scope="session")
def drafters(tiny_dir, llama_target, qwen3_target) -> dict[tuple[str, int], Path]:
    """Reference-built drafters for each target at depths 1, 2 and 3."""
    out = {}
    for name, target in (("llama", llama_target), ("qwen3", qwen3_target)):
        for depth, layer_ids in ((1, [1]), (2, [0, 2]), (3, [0, 1, 3])):
            out[name, depth] = make_drafter(
                tiny_dir / f"{name}-d{depth}", target, num_layers=depth, target_layer_ids=layer_ids, seed=10 + depth
            )
    return out


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory) -> dict[str, Path]:
    """The bundled tiny target converted once per session to F16 and Q8_0 (test_gguf, test_session)."""
    pytest.importorskip("gguf")
    from dflash_local.gguf.convert import convert

    root, tiny = tmp_path_factory.mktemp("gguf"), Path(__file__).resolve().parent.parent / "models" / "tiny"
    return {kind: convert(tiny / "target", root / f"tiny-{kind}.gguf", kind, threads=1) for kind in ("f16", "q8_0")}


@pytest.fixture(scope="session")
def heldout() -> list[list[int]]:
    """The bundled pair's first 10 held-out prompts, tokenized: their last 48 tokens (the GGUF tests)."""
    import json

    from dflash_local.tokenizer import TextTokenizer

    tiny = Path(__file__).resolve().parent.parent / "models" / "tiny"
    tokenizer = TextTokenizer.load(tiny / "target")
    lines = (tiny / "heldout_prompts.jsonl").read_text().splitlines()[:10]
    return [tokenizer.encode(json.loads(line)["prompt"])[-48:] for line in lines]


@pytest.fixture(scope="session")
def drafter():
    """The bundled DFlash drafter, 2048-token context cache (the GGUF tests)."""
    from dflash_local.drafters.torch_drafter import DFlashDrafter
    from dflash_local.runtime import LoadSpec

    return DFlashDrafter.load(
        Path(__file__).resolve().parent.parent / "models" / "tiny" / "drafter", LoadSpec(max_context=2048)
    )


@pytest.fixture(scope="session")
def vision_model(tmp_path_factory) -> Path:
    """tests/tiny_archs.py's gemma3-vision, built once per session: hf/, hf-text/, model.gguf and mmproj.gguf."""
    from test_architectures import build_tiny

    return build_tiny(tmp_path_factory.mktemp("vision"), "gemma3-vision") / "gemma3-vision"


@pytest.fixture(scope="session")
def vision_drafter(vision_model, tmp_path_factory) -> Path:
    """A one-layer block-16 DFlash drafter trained by `dflash train` for gemma3-vision's text model (its own greedy
    continuations of the bundled held-out prompts, through llama.cpp): text only, as `dflash train` takes."""
    from dflash_local.train.pipeline import TrainRequest, run_training
    from dflash_local.train.selfdistill import DistillSettings
    from dflash_local.train.trainer import TrainSettings

    out = tmp_path_factory.mktemp("vision-drafter") / "drafter"
    request = TrainRequest(
        target=vision_model / "model.gguf",
        corpus=[Path(__file__).resolve().parent.parent / "models" / "tiny" / "heldout_prompts.jsonl"],
        out=out,
        prompt_tokens=16,
        draft_vocab=512,
        threads=1,
        distill=DistillSettings(new_tokens=48, batch_size=20, shard_size=20, sampled_fraction=0.0),
        train=TrainSettings(layers=1, block_size=16, steps=200, batch_size=8, anchors=8, warmup=10, eval_every=200),
    )
    for _ in run_training(request):
        pass
    return out


@pytest.fixture(autouse=True, scope="session")
def _state_home(tmp_path_factory):
    """dflash's own state (block-size calibrations, pull records) and the Hugging Face cache (the Gemma GGUF the
    registry package assembles, checking its sha256) go to this test run's folders, not the user's; so does
    matplotlib's font cache (`dflash bench --plot`), which it would write under ~/.cache."""
    os.environ["DFLASH_HOME"] = str(tmp_path_factory.mktemp("dflash-home"))
    os.environ["MPLCONFIGDIR"] = str(tmp_path_factory.mktemp("matplotlib"))
    os.environ["HF_HOME"] = str(tmp_path_factory.mktemp("hf-home"))
    os.environ.pop("HF_HUB_CACHE", None)  # it would win over HF_HOME


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    """Tiny models gain nothing from threads, and two busy processes on 2 cores make OpenMP spin."""
    import torch

    torch.set_num_threads(1)


# The files that take longest start first, so that none runs last, alone: test_gpu_backends (lavapipe runs every
# architecture; 1,650 s of the suite's 1,789 s wall in one worker on a busy 2-core machine, 2026-12-07), then
# test_architectures (its GGUF builds in the oracle, its hybrid T > 0 test), test_gemma (its chi-square test), and the
# rest less.
SLOWEST_FIRST = (
    "test_gpu_backends.py",
    "test_architectures.py",
    "test_gemma.py",
    "test_sampled_lossless.py",
    "test_gguf_lossless.py",
    "test_sampling.py",
    "test_kernels_compile.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the slowest files first (a stable sort: each file's tests keep their order)."""
    rank = {name: index for index, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


# Top-level modules that `./install.sh --dev` installs: a test that skips for want of one of them fails instead.
DEV_INSTALLED = {"llama_cpp", "gguf", "bitsandbytes", "triton", "scipy", "pexpect", "matplotlib"}
IMPORT_SKIP = re.compile(r"could not import '([\w.]+)'")


def _missing_dev_module(report: pytest.CollectReport | pytest.TestReport) -> str | None:
    """The dev-installed module whose importorskip turned this report into a skip, if any."""
    if not report.skipped or not isinstance(report.longrepr, tuple):
        return None
    found = IMPORT_SKIP.search(str(report.longrepr[2]))
    return found.group(1) if found and found.group(1).split(".")[0] in DEV_INSTALLED else None


def _fail(report: pytest.CollectReport | pytest.TestReport, module: str) -> None:
    report.outcome = "failed"
    report.longrepr = (
        f"{report.nodeid}: skipped because '{module}' cannot be imported, but ./install.sh --dev installs it: "
        f"the dev install is broken ({report.longrepr[2]})"
    )


def environ_captured_at_import(source: str) -> int | None:
    """The line of a test module's top-level code that reads os.environ beyond one variable's .get (a copy made at
    import misses DFLASH_HOME and HF_HOME, which _state_home sets later), or None. Rule: ENVIRON_AT_IMPORT."""
    statements = [s for s in ast.parse(source).body if not isinstance(s, (ast.FunctionDef, ast.ClassDef, ast.Import))]
    for statement in statements:
        nodes, pending = [], [statement]
        while pending:  # ast.walk, but not into lambdas (they run later)
            node = pending.pop()
            nodes.append(node)
            pending += [child for child in ast.iter_child_nodes(node) if not isinstance(child, ast.Lambda)]
        one_variable = {
            id(n.func.value)
            for n in nodes
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "get"
        }
        for node in nodes:
            attribute = isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "os"
            environ = (attribute and node.attr == "environ") or (isinstance(node, ast.Name) and node.id == "environ")
            if environ and id(node) not in one_variable:
                return node.lineno
    return None


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    """A module-level importorskip of a dev-installed package fails collection, and so does a test module whose
    top-level code copies os.environ (ENVIRON_AT_IMPORT)."""
    outcome = yield
    report = outcome.get_result()
    if module := _missing_dev_module(report):
        _fail(report, module)
    if isinstance(collector, pytest.Module) and collector.path.name.startswith("test_"):
        line = environ_captured_at_import(collector.path.read_text())
        if line is not None:
            report.outcome = "failed"
            report.longrepr = (
                f"ENVIRON_AT_IMPORT: {collector.path.name}:{line} reads os.environ at import, before the session's "
                "DFLASH_HOME and HF_HOME are set: read it inside the test (or a function it calls)"
            )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """An importorskip of a dev-installed package inside a test or fixture fails the test."""
    outcome = yield
    report = outcome.get_result()
    if module := _missing_dev_module(report):
        _fail(report, module)
