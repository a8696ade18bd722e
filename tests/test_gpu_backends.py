"""llama.cpp's Vulkan backend on Mesa's lavapipe, a software Vulkan device that runs the GPU code path on the CPU: the
dev install builds the Vulkan libllama, doctor lists the backend and the device, every tapped architecture and the
bundled tiny pair run there (all layers and the native drafter), DFlash at blocks 4, 16 and auto equals plain decoding
on that device (with a q4_0 KV cache too, and after an image in the prompt), and so does MTP drafting, partial offload
and --cpu-moe write the same text as full offload, and a device that is not there is one sentence. Each run is its own
process: llama.cpp is told which Vulkan devices it may use before it loads."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from one_error import assert_one_error
from test_architectures import (  # noqa: F401 (the tiny architectures, drafters)
    ARCHS,
    PAST_THE_WINDOW,
    WINDOWED,
    build_tiny,
    drafters,
    models,
)
from test_mtp import model as mtp_model  # noqa: F401 (the tiny qwen35 with an MTP layer)

from dflash_local import offload
from dflash_local.kv_cache import KVCache
from dflash_local.llama_lib import GPU_LIBS, INVARIANT_LIB
from dflash_local.targets.llamacpp import FIXED_ROWS
from dflash_local.vulkan_probe import vulkan_devices

TESTS = Path(__file__).resolve().parent
TINY = TESTS.parent / "models" / "tiny"
PROMPT = "5,17,99,3,42,7,8,120,11,12"
NEW_TOKENS = 16
HYBRIDS = ("qwen35", "lfm2")
LONG_PROMPTS = f"{PROMPT};300,7,1999,64,5,880,12"
COPY_PROMPT = ",".join(["40,41,42,43,44,45,46,47,48,49,50,51"] * 6)  # 72 ids: CPU layers take the prompt kernels
LONG_TOKENS = 48


def clean_env() -> dict[str, str]:
    """This process's environment without the library and device choices a run makes for itself."""
    return {k: v for k, v in os.environ.items() if k not in ("GGML_VK_VISIBLE_DEVICES", "LLAMA_CPP_LIB_PATH")}


def gpu_runs(
    device: str,
    layers: str,
    cpu_moe: bool,
    pairs: list[str],
    prompts: str = PROMPT,
    tokens: int = NEW_TOKENS,
    cache: str = "f16",
    context: int = 256,
) -> list[dict]:
    """tests/gpu_runs.py in its own process, the targets' KV cache of type `cache`, their context `context`: one dict
    per target (ids per mode and prompt, steps, devices)."""
    argv = [sys.executable, TESTS / "gpu_runs.py", "--cache-type", cache, "--max-context", context]
    argv += [device, layers, "1" if cpu_moe else "0"]
    argv += [str(tokens), prompts]
    done = subprocess.run([*map(str, argv), *pairs], capture_output=True, text=True, env=clean_env(), timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines()]


def dflash(*args: str, env: dict | None = None, stdin: str | None = None) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "dflash_local", *args]
    return subprocess.run(argv, input=stdin, capture_output=True, text=True, env=env or clean_env(), timeout=600)


def test_the_dev_install_built_the_vulkan_libllama_and_the_machine_has_a_vulkan_device():
    assert (GPU_LIBS["vulkan"] / "libggml-vulkan.so").is_file(), "./install.sh --dev --gpu vulkan builds it"
    assert vulkan_devices(), "./install.sh --dev --gpu vulkan installs Mesa's software Vulkan device where none is"


def test_doctor_lists_the_vulkan_backend_and_the_loaders_device():
    """The device llama.cpp lists is the one the Vulkan loader reports (read independently, through libvulkan)."""
    done = dflash("doctor")
    assert done.returncode in (0, 1), done.stderr
    out = " ".join(done.stdout.split())
    backends = re.search(r"llama\.cpp backends ([\w, ]+?) (ok|--|!!) ", out)
    assert backends and set(backends.group(1).split(", ")) == {"CPU", "Vulkan"}, out
    name = vulkan_devices()[0].name
    assert f"device Vulkan0 Vulkan: {name}" in out, out
    software = "(software: only an explicit --device uses it)"
    assert (software in out) == (vulkan_devices()[0].kind == "CPU (software)"), out


def test_every_architecture_runs_on_vulkan_and_dflash_equals_plain_decoding_there(models, drafters, tiny_gguf):  # noqa: F811
    """All layers and the native drafter on Vulkan0; blocks 4 and 16 and auto (several sizes chosen) give plain
    decoding's ids on the same device, for each tapped architecture and the bundled tiny pair."""
    pairs = [f"{models[arch] / 'model.gguf'}:{drafters[arch]}" for arch in ARCHS]
    pairs.append(f"{tiny_gguf['f16']}:{TINY / 'drafter'}")
    runs = gpu_runs("vulkan", "auto", False, pairs)
    assert len(runs) == len(pairs)
    for run in runs:
        target, drafter = run["devices"]["target"], run["devices"]["drafter"]
        assert (target["device"], target["backend"], drafter["device"]) == ("Vulkan0", "Vulkan", "Vulkan0"), run
        assert target["layers_on_device"] == target["layers"] and target["output_on_device"], run
        assert drafter["kind"] == "native", run
        for mode in ("lookup", "4", "16", "auto"):
            assert run[mode] == run["plain"], (run["target"], mode)
        assert len(run["auto_blocks"]) > 1, run


def test_dflash_equals_plain_decoding_on_vulkan_past_the_window_cache(models, drafters):  # noqa: F811
    """gemma4 and gpt-oss (sliding window 8, a window cache of 768 cells) on Vulkan0 after a 900-token prompt, the
    cache's cells reused: lookup and blocks 4, 16 and auto give plain decoding's ids on the device, drafts accepted."""
    pairs = [f"{models[arch] / 'model.gguf'}:{drafters[arch]}" for arch in WINDOWED]
    prompt = ",".join(map(str, PAST_THE_WINDOW))
    runs = gpu_runs("vulkan", "auto", False, pairs, prompt, NEW_TOKENS, context=1024)
    for run in runs:
        for mode in ("lookup", "4", "16", "auto"):
            assert run[mode] == run["plain"], (run["target"], mode)
    accepted = [length for run in runs for _, length in run["lookup_steps"] + run["auto_steps"]]
    assert max(accepted) > 1, runs  # gemma4's output repeats, and lookup drafts it


def test_dflash_with_an_image_equals_plain_decoding_on_vulkan(vision_model, vision_drafter):
    """gemma3-vision on Vulkan0 (every layer, the native drafter `dflash train` trained; the projector on the CPU):
    after an image prompt, blocks 4 and 16 and auto (several sizes chosen; with lookup's drafts too, which are
    accepted) give plain decoding's ids on the same device; another image, or the image's rows fed causally (a broken
    feed), give other ids there."""
    argv = [sys.executable, TESTS / "gpu_vision_runs.py", "vulkan", vision_model / "model.gguf"]
    argv += [vision_model / "mmproj.gguf", vision_drafter, 16, 0, 1]
    done = subprocess.run([*map(str, argv)], capture_output=True, text=True, env=clean_env(), timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    run = json.loads(done.stdout)
    target, drafter = run["devices"]["target"], run["devices"]["drafter"]
    assert (target["device"], drafter["device"], drafter["kind"]) == ("Vulkan0", "Vulkan0", "native"), run
    assert target["layers_on_device"] == target["layers"], run
    plain, other = run["plain"]
    for mode in ("4", "16", "auto", "auto_lookup"):
        assert run[mode] == [plain], mode
    assert run["tau_auto_lookup"] > 1.5, run  # blocks accepted with the image's rows in the caches
    assert len({size for size, _ in run["auto_steps"]}) > 1, run["auto_steps"]
    assert other != plain and run["causal"] != [plain], run


@pytest.mark.parametrize("layers", ["all", "2"])
def test_verify_rows_equal_one_token_steps_bitwise_on_vulkan(layers, models):  # noqa: F811
    """benchmarks/verify_rows.py on Vulkan0: a 16-row verify's logits, as dflash runs it, equal 16 one-token steps'
    bit for bit on the hybrids (qwen35, lfm2: recurrent state beside attention) and a dense target, with every layer
    or 2 of 4 on the device; as one 16-row forward they do not (the kernels GPU backends choose by row count)."""
    targets = ",".join(str(models[arch] / "model.gguf") for arch in (*HYBRIDS, "qwen3moe"))
    argv = [sys.executable, "-m", "benchmarks.verify_rows", "--device", "vulkan", "--target", targets]
    argv += ["--rows", "16", "--gpu-layers", layers]
    done = subprocess.run(argv, capture_output=True, text=True, env=clean_env(), cwd=TESTS.parent, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(results) == 6, done.stdout
    for result in results:
        assert result["placed"].startswith("Vulkan0") and f"{4 if layers == 'all' else 2}/4 layers" in result["placed"]
        if result["verification"] == "as dflash runs it":
            assert result["bitwise_equal_rows"] == result["rows"] == 16, result
        else:
            assert result["bitwise_equal_rows"] < result["rows"], result


@pytest.fixture(scope="module")
def weak_lfm2(tmp_path_factory) -> Path:
    """tests/tiny_archs.py's lfm2-weak GGUF: lfm2 with weak layers, which mostly repeats its last token."""
    return build_tiny(tmp_path_factory.mktemp("weak"), "lfm2-weak") / "lfm2-weak" / "model.gguf"


def test_hybrids_on_vulkan_equal_plain_decoding_over_long_outputs(models, drafters, weak_lfm2, mtp_model):  # noqa: F811
    """Hybrids (recurrent state beside attention) on Vulkan0, 48 tokens: qwen35 and lfm2 with their drafters from two
    prompts, blocks 4, 16, auto and lookup, drafts rejected; their weak variants (which mostly repeat their last
    token) from a copy-heavy prompt by lookup, with every layer or 2 of 4 on the device, blocks accepted past a verify
    forward's 8 rows. Every mode gives plain decoding's ids there."""
    pairs = [f"{models[arch] / 'model.gguf'}:{drafters[arch]}" for arch in HYBRIDS]
    runs = gpu_runs("vulkan", "all", False, pairs, LONG_PROMPTS, LONG_TOKENS)
    weak = [str(weak_lfm2), str(mtp_model / "model.gguf")]
    runs += [
        run | {"layers": layers}
        for layers in ("all", "2")
        for run in gpu_runs("vulkan", layers, False, weak, COPY_PROMPT, LONG_TOKENS)
    ]
    assert len(runs) == 6
    for run in runs:
        placed = run["devices"]["target"]
        assert placed["device"] == "Vulkan0" and placed["layers_on_device"] == (2 if run.get("layers") == "2" else 4)
        assert all(len(ids) == LONG_TOKENS for ids in run["plain"]), run["plain"]
        modes = [mode for mode in ("lookup", "4", "16", "auto") if mode in run]
        for mode in modes:
            assert run[mode] == run["plain"], (run["target"], run.get("layers"), mode)
        steps = [(size, length) for mode in modes for size, length in run[f"{mode}_steps"] if size > 1]
        assert any(length < size for size, length in steps), ("no draft was rejected", run["target"])
        if "4" not in run:  # the weak variants by lookup
            assert any(length > FIXED_ROWS for _, length in steps), ("no block accepted past 8 rows", run["target"])


def test_mtp_drafts_on_vulkan_and_equals_plain_decoding_there(mtp_model):  # noqa: F811
    """--drafter mtp on Vulkan0 (the tiny qwen35 with an MTP layer, every layer on the device): blocks 4 and 8 and auto
    give plain decoding's ids on the same device."""
    gguf = mtp_model / "model.gguf"
    (run,) = gpu_runs("vulkan", "all", False, [f"{gguf}:{gguf}"])
    target, drafter = run["devices"]["target"], run["devices"]["drafter"]
    assert (target["device"], drafter["device"], target["layers_on_device"]) == ("Vulkan0", "Vulkan0", 4), run
    for mode in ("4", "8", "auto"):
        assert run[mode] == run["plain"], mode


def test_a_quantized_kv_cache_on_vulkan_drafts_as_plain_decoding_with_it(tiny_gguf):
    """The bundled pair, every layer and the native drafter on Vulkan0, a q4_0 KV cache there: blocks 4, 16 and auto
    give plain decoding's ids with that cache."""
    pair = f"{tiny_gguf['q8_0']}:{TESTS.parent / 'models' / 'tiny' / 'drafter'}"
    (run,) = gpu_runs("vulkan", "all", False, [pair], cache="q4_0")
    target = run["devices"]["target"]
    assert (target["device"], target["layers_on_device"], target["kv_cache"]["v"]) == ("Vulkan0", 8, "q4_0"), run
    for mode in ("4", "16", "auto"):
        assert run[mode] == run["plain"], mode


def test_partial_offload_and_cpu_moe_write_the_same_text_as_full_offload(models):  # noqa: F811
    moe = str(models["qwen3moe"] / "model.gguf")
    (full,) = gpu_runs("vulkan", "all", False, [moe])
    (partial,) = gpu_runs("vulkan", "2", False, [moe])
    (experts,) = gpu_runs("vulkan", "all", True, [moe])
    assert partial["plain"] == full["plain"] == experts["plain"]
    assert (partial["devices"]["target"]["layers_on_device"], partial["devices"]["target"]["layers"]) == (2, 4)
    assert experts["devices"]["target"]["cpu_moe"] and not full["devices"]["target"]["cpu_moe"]


def test_cpu_moe_counts_no_expert_tensor_on_the_device(models):  # noqa: F811
    """The planner's per-layer bytes with --cpu-moe leave out exactly the expert tensors gguf-py's reader lists."""
    from test_offload import CONTEXT, kv_per_layer, reference_sizes

    moe = models["qwen3moe"] / "model.gguf"
    with_experts, _, _ = reference_sizes(moe, cpu_moe=False)
    without, _, _ = reference_sizes(moe, cpu_moe=True)
    assert sum(without) < sum(with_experts)
    planned, _ = offload._per_layer(offload.read_gguf(moe), True, CONTEXT, KVCache())
    assert planned == [size + kv_per_layer(moe) for size in without]


def test_generate_json_says_where_the_target_and_the_drafter_ran(tiny_gguf):
    done = dflash(
        "generate", "--target", str(tiny_gguf["f16"]), "--drafter", str(TINY / "drafter"), "--device", "vulkan",
        "--prompt-ids", PROMPT, "--max-new-tokens", "8", "--block-size", "4", "--json", "--threads", "1",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    devices = json.loads(done.stdout)["devices"]
    assert devices["target"]["device"] == devices["drafter"]["device"] == "Vulkan0", devices
    assert devices["target"]["layers_on_device"] == devices["target"]["layers"], devices
    assert "placed: target on Vulkan0" in done.stderr, done.stderr


def test_grammar_constrained_dflash_equals_constrained_plain_decoding_on_vulkan(tiny_gguf, tmp_path):
    """--json-schema on Vulkan0: blocks 16 and auto write plain decoding's constrained text there, drafts accepted."""
    fields = {"name": {"type": "string"}, "n": {"type": "integer"}}
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": fields, "required": ["name", "n"]}))
    runs = {}
    for mode in ("--no-draft", "16", "auto"):
        chosen = [mode] if mode.startswith("--") else ["--block-size", mode]
        done = dflash(
            "generate", "--target", str(tiny_gguf["f16"]), "--drafter", str(TINY / "drafter"), "--device", "vulkan",
            "--prompt", "Write a record:", "--json-schema", str(schema), "--max-new-tokens", "24", "--json",
            "--threads", "1", *chosen,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        runs[mode] = json.loads(done.stdout)
        assert runs[mode]["devices"]["target"]["device"] == "Vulkan0", runs[mode]
    assert runs["--no-draft"]["text"].startswith('{"name": "'), runs["--no-draft"]
    assert runs["16"]["text"] == runs["auto"]["text"] == runs["--no-draft"]["text"]
    assert runs["16"]["tau"] > 1 and runs["auto"]["tau"] > 1, runs


def test_chat_says_where_the_target_and_the_drafter_run(tiny_gguf):
    """Piped chat on Vulkan0: the status line (stderr) ends with the device, /stats (stdout) has the placement."""
    done = dflash(
        "chat", str(tiny_gguf["f16"]), "--drafter", str(TINY / "drafter"), "--device", "vulkan",
        "--max-new-tokens", "4", "--threads", "1", stdin="Hello there\n/stats\n",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    status = [line for line in done.stderr.splitlines() if "tok/s" in line]
    assert status and status[-1].endswith(" · on Vulkan0"), done.stderr
    assert "placed: target on Vulkan0 (" in done.stdout and "; drafter on Vulkan0" in done.stdout, done.stdout


def test_train_distills_through_the_vulkan_backend(tiny_gguf, tmp_path):
    """dflash train --device vulkan on a GGUF: llama.cpp continues the prompts on Vulkan0 (the progress says so), the
    drafter trains in torch on the CPU and is written."""
    corpus = TINY / "heldout_prompts.jsonl"
    done = dflash(
        "train", "--target", str(tiny_gguf["q8_0"]), "--corpus", str(corpus), "--out", str(tmp_path / "drafter"),
        "--device", "vulkan", "--prompt-tokens", "16", "--max-prompts", "4", "--new-tokens", "8",
        "--distill-batch", "4", "--layers", "1", "--block-size", "4", "--steps", "2", "--batch-size", "2",
        "--anchors", "2", "--warmup", "1", "--eval-every", "2", "--threads", "1",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    output = " ".join((done.stdout + done.stderr).split())
    assert "self-distilling with the target on Vulkan0 (" in output and "8/8 layers" in output, output
    assert (tmp_path / "drafter" / "model.safetensors").is_file()


@pytest.mark.parametrize(
    ("device", "lib", "fragment"),
    [
        ("cuda", None, "only; ./install.sh --gpu cuda builds one with CUDA"),
        ("Vulkan7", None, "Unknown device 'Vulkan7' (use auto, cpu, cuda, vulkan, metal, Vulkan0)"),
        ("vulkan", INVARIANT_LIB, "this libllama is built for CPU only; ./install.sh --gpu vulkan builds one"),
    ],
)
def test_a_device_that_is_not_there_is_one_sentence(device, lib, fragment, tiny_gguf):
    env = clean_env() | ({"LLAMA_CPP_LIB_PATH": str(lib)} if lib else {})
    args = ["generate", "--target", str(tiny_gguf["f16"]), "--no-draft", "--prompt-ids", "1,2", "--device", device]
    assert_one_error(dflash(*args, env=env), fragment)
