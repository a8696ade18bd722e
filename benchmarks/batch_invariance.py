"""Which llama.cpp CPU switch makes a B-token forward bitwise equal to B one-token forwards, per GGUF type.

For each configuration a fresh process (libllama and the ggml env switches are set once per process) loads each
GGUF, decodes a random prefix, then compares the logits of one B-token llama_decode with those of B one-token
llama_decodes from the same prefix. A 600-token prefix exercises flash attention's split-KV path (one query,
>= 512 KV cells); 40 does not.

    .venv/bin/python -m benchmarks.batch_invariance                 # the tiny target's types, every configuration
    .venv/bin/python -m benchmarks.batch_invariance --types "" --synth x.gguf,y.gguf --configs default,dflash
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TYPES = ("f16", "q8_0", "q4_0", "q4_k_m", "q5_k_m", "q6_k")
PREFIXES = (40, 600)
BATCHES = (4, 16)
PREFILL = 256  # --speed: prompt tokens in the timed prefill
TILED_OFF = {"GGML_CPU_TILED_MM": "0"}
FUSION_OFF = {"GGML_CPU_DISABLE_FUSION": "1"}
# name -> (libllama, environment, model params, context params); libllama: "stock" (llama-cpp-python's) or
# "invariant" (tools/build_libllama.sh's CPU build: prompt rows apart from verify rows); "dflash": what
# dflash_local.llama_lib sets and targets.llamacpp loads with
CONFIGS = {
    "dflash": (None, None, None, {}),
    "default": ("stock", {}, {}, {}),
    "tiled-off": ("stock", TILED_OFF, {}, {}),
    "fusion-off": ("stock", FUSION_OFF, {}, {}),
    "no-repack": ("stock", {}, {"use_extra_bufts": False}, {}),
    "fa-off": ("stock", {}, {}, {"flash_attn_type": 0}),
    "prompt-rows": ("invariant", {}, {}, {}),
    "tiled-off+no-repack": ("stock", TILED_OFF, {"use_extra_bufts": False}, {}),
    "all": ("invariant", {**TILED_OFF, **FUSION_OFF}, {"use_extra_bufts": False}, {"flash_attn_type": 0}),
}


class Context:
    """A llama.cpp model and context under one configuration's model and context parameters."""

    def __init__(self, path: str, config: str, threads: int, n_ctx: int = 1024) -> None:
        import llama_cpp

        *_, model_fields, ctx_fields = CONFIGS[config]
        if model_fields is None:
            from dflash_local.targets.llamacpp import model_params as project_params

            model_params = project_params("cpu")
        else:
            model_params = llama_cpp.llama_model_default_params()
            model_params.n_gpu_layers = 0
            model_params.load_mode = llama_cpp.LLAMA_LOAD_MODE_NONE  # as dflash loads targets
            for name, value in model_fields.items():
                setattr(model_params, name, value)
        self.model = llama_cpp.llama_model_load_from_file(path.encode(), model_params)
        params = llama_cpp.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max = n_ctx, n_ctx, 512, 1
        params.n_threads = params.n_threads_batch = threads
        for name, value in ctx_fields.items():
            setattr(params, name, value)
        self.ctx = llama_cpp.llama_init_from_model(self.model, params)
        self.memory = llama_cpp.llama_get_memory(self.ctx)
        self.vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.batch = llama_cpp.llama_batch_init(n_ctx, 0, 1)

    def decode(self, start: int, ids: list[int]):
        """Logits of every id, decoded in one llama_decode at positions start.."""
        import llama_cpp
        import numpy as np

        batch = self.batch
        batch.n_tokens = len(ids)
        for index, token in enumerate(ids):
            batch.token[index], batch.pos[index] = token, start + index
            batch.n_seq_id[index], batch.seq_id[index][0], batch.logits[index] = 1, 0, True
        assert llama_cpp.llama_decode(self.ctx, batch) == 0
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits(self.ctx), shape=(len(ids), self.vocab)).copy()

    def keep(self, length: int) -> None:
        import llama_cpp

        llama_cpp.llama_memory_seq_rm(self.memory, 0, length, -1)

    def close(self) -> None:
        import llama_cpp

        llama_cpp.llama_batch_free(self.batch)
        llama_cpp.llama_free(self.ctx)
        llama_cpp.llama_model_free(self.model)


def start(config: str, libraries: dict[str, str]) -> None:
    """This process's libllama and ggml environment for config (before llama_cpp's import, which loads the library,
    and llama.cpp's first compute: ggml reads its variables once)."""
    for name in ("GGML_CPU_TILED_MM", "GGML_CPU_DISABLE_FUSION", "LLAMA_CPP_LIB_PATH"):
        os.environ.pop(name, None)
    library, env = CONFIGS[config][:2]
    if env is None:
        import dflash_local.llama_lib  # noqa: F401  (sets dflash's environment and loads its libllama)
    else:
        # tiled matmul on unless the config turns it off: dflash_local.llama_lib, imported below for the log switch,
        # would otherwise turn it off
        os.environ.update({"GGML_CPU_TILED_MM": "1", **env, "LLAMA_CPP_LIB_PATH": libraries[library]})
    import llama_cpp

    from dflash_local.llama_lib import quiet_llama_logs

    quiet_llama_logs()
    llama_cpp.llama_backend_init()


def invariance(paths: dict[str, str], config: str, threads: int, libraries: dict[str, str]) -> dict:
    """{type: {f"{prefix}/{batch}": rows of the batch whose logits differ bitwise from one-token decodes}}."""
    import numpy as np

    start(config, libraries)
    results = {}
    for kind, path in paths.items():
        model = Context(path, config, threads)
        tokens = np.random.default_rng(0).integers(5, model.vocab, max(PREFIXES) + max(BATCHES)).tolist()
        decode = model.decode
        row = {}
        for prefix in PREFIXES:
            model.keep(0)
            decode(0, tokens[:prefix])
            for size in BATCHES:
                block = tokens[prefix : prefix + size]
                model.keep(prefix)
                together = decode(prefix, block)
                model.keep(prefix)
                alone = np.concatenate([decode(prefix + i, [token]) for i, token in enumerate(block)])
                row[f"{prefix}/{size}"] = int((together != alone).any(axis=1).sum())
        results[kind] = row
        model.close()
    return results


def speed(paths: dict[str, str], config: str, threads: int, libraries: dict[str, str]) -> dict:
    """{type: tokens/s of a 512-token prefill, of 16-token verify batches and of one-token decodes}."""
    import numpy as np

    start(config, libraries)
    results = {}
    for kind, path in paths.items():
        model = Context(path, config, threads)
        tokens = np.random.default_rng(1).integers(5, model.vocab, PREFILL + 64).tolist()
        model.decode(0, tokens[:16])  # warm-up
        model.keep(0)
        began = time.perf_counter()
        model.decode(0, tokens[:PREFILL])
        prefill = PREFILL / (time.perf_counter() - began)
        began = time.perf_counter()
        for step in range(4):
            model.keep(PREFILL)
            model.decode(PREFILL, tokens[PREFILL + 16 * step : PREFILL + 16 * (step + 1)])
        verify = 64 / (time.perf_counter() - began)
        model.keep(PREFILL)
        began = time.perf_counter()
        for step in range(64):
            model.decode(PREFILL + step, tokens[PREFILL + step : PREFILL + step + 1])
        results[kind] = {"prefill": prefill, "verify16": verify, "decode": 64 / (time.perf_counter() - began)}
        model.close()
    return results


def convert_all(folder: Path, types: list[str]) -> dict[str, str]:
    from dflash_local.gguf.convert import convert

    return {kind: str(convert(ROOT / "models/tiny/target", folder / f"tiny-{kind}.gguf", kind, 1)) for kind in types}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", default=",".join(TYPES))
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    parser.add_argument("--synth", default="", help="also these GGUFs, comma-separated (e.g. real-shape synthetics)")
    parser.add_argument("--speed", action="store_true", help="measure tokens/s per configuration instead")
    parser.add_argument("--rounds", type=int, default=3, help="--speed: runs per configuration (best kept)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        job, config, threads, paths, libraries = json.loads(args.worker)
        print(json.dumps({"invariance": invariance, "speed": speed}[job](paths, config, threads, libraries)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        paths = convert_all(Path(tmp), [t for t in args.types.split(",") if t])
        paths.update({Path(path).stem: path for path in args.synth.split(",") if path})
        configs, thread_counts = args.configs.split(","), [int(t) for t in args.threads.split(",")]
        if args.speed:
            report_speed(paths, configs, thread_counts, args.rounds)
            return
        columns = [f"{p}/{b}" for p in PREFIXES for b in BATCHES]
        print(f"rows (of B) whose logits differ bitwise, one B-token decode vs B one-token decodes; {columns}")
        for threads in thread_counts:
            for config in configs:
                results = measure("invariance", config, threads, paths)
                cells = "  ".join(f"{kind}:{'/'.join(str(v) for v in row.values())}" for kind, row in results.items())
                print(f"threads={threads} {config:<20} {cells}", flush=True)


def libraries() -> dict[str, str]:
    """The libllama folders: llama-cpp-python's own and the one tools/build_libllama.sh makes."""
    from dflash_local.llama_lib import INVARIANT_LIB, llama_cpp

    return {"stock": str(Path(llama_cpp.__file__).parent / "lib"), "invariant": str(INVARIANT_LIB)}


def measure(job: str, config: str, threads: int, paths: dict[str, str]) -> dict:
    """Run one worker process and return its results."""
    job_args = json.dumps([job, config, threads, paths, libraries()])
    command = [sys.executable, "-m", "benchmarks.batch_invariance", "--worker", job_args]
    out = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def report_speed(paths: dict[str, str], configs: list[str], thread_counts: list[int], rounds: int) -> None:
    """Each configuration `rounds` times, interleaved (a busy machine slows them alike); the best of each is shown."""
    best: dict[tuple[int, str], dict] = {}
    for _ in range(rounds):
        for threads in thread_counts:
            for config in configs:
                for kind, row in measure("speed", config, threads, paths).items():
                    kept = best.setdefault((threads, config), {}).setdefault(kind, row)
                    best[threads, config][kind] = {k: max(v, kept[k]) for k, v in row.items()}
    print(f"tokens/s, best of {rounds}: {PREFILL}-token prefill / 16-token verify batches / one-token decode")
    for (threads, config), results in best.items():
        cells = "  ".join(f"{kind}:{'/'.join(f'{v:.1f}' for v in row.values())}" for kind, row in results.items())
        print(f"threads={threads} {config:<20} {cells}", flush=True)


if __name__ == "__main__":
    main()
