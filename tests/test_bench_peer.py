"""`dflash bench --peer llama-server` against a fake llama-server (tests/fake_llama_server.py): the table's counts of
outputs identical to each engine's own plain decoding, a refused drafter reported in its row, and the errors a user
can cause, each in one sentence. The real llama-server is measured in docs/benchmarks.md, not here (its build takes
minutes)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from in_process import invoke

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "models" / "tiny"


@pytest.fixture(scope="module")
def fake_server(tmp_path_factory) -> Path:
    """An executable that runs the fake server with this Python."""
    path = tmp_path_factory.mktemp("peer") / "llama-server"
    path.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{Path(__file__).parent / "fake_llama_server.py"}" "$@"\n')
    path.chmod(0o755)
    return path


def bench_args(gguf: Path, *extra: str | Path) -> list[str | Path]:
    common = ("--drafter", TINY / "drafter", "--prompts", TINY / "heldout_prompts.jsonl", "--limit", "2")
    return ["bench", gguf, *common, "--max-new-tokens", "6", "--block-size", "4", "--threads", "1", *extra]


def test_peer_counts_each_engines_outputs_against_its_own_plain(tiny_gguf, fake_server):
    result = invoke(*bench_args(tiny_gguf["q8_0"], "--peer", "llama-server", "--peer-binary", fake_server, "--json"))
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["all_identical"] is True  # dflash's own rows, from the bench itself
    modes = report["peer"]["modes"]
    assert set(modes) == {"plain", "draft-dflash"}  # the tiny GGUF has no MTP layers
    plain, dflash = modes["plain"], modes["draft-dflash"]
    assert plain["error"] is None and dflash["error"] is None
    assert dflash["identical"] == 1 and dflash["compared"] == 2  # the fake's second speculative answer differs
    assert plain["identical"] is None
    assert [len(row["ids"]) for row in dflash["prompts"]] == [6, 6]
    assert dflash["mean"]["decode_tokens_per_s"] == pytest.approx(5 / 0.06)  # (n - 1) tokens over predicted_ms
    assert dflash["mean"]["tau"] == pytest.approx(1 + 2 / 3)  # 1 + accepted / steps, from /metrics' counters
    assert plain["mean"]["tau"] == 0.0
    assert plain["identical_to_dflash_plain"] == 0  # the fake's ids are not the tiny target's


@pytest.mark.parametrize(
    ("fault", "reason"),
    [
        ("FAKE_REFUSE", "exited with 1: llama_model_load: error loading model: unknown model architecture: 'dflash'"),
        ("FAKE_CRASH", "exited with -6: llama-graph.cpp:1384: GGML_ASSERT(t_layer_inp[il] != nullptr) failed"),
    ],
)
def test_the_table_shows_counts_and_a_failed_mode(tiny_gguf, fake_server, fault, reason):
    env = {fault: "1", "DFLASH_LLAMA_SERVER": str(fake_server)}
    result = invoke(*bench_args(tiny_gguf["q8_0"], "--peer", "llama-server"), env=env)
    assert result.exit_code == 0, result.stderr
    table = " ".join(result.stdout[result.stdout.index("dflash and llama-server") :].replace("│", " ").split())
    assert "2/2" in table  # dflash's drafting output equals its plain one for both prompts
    assert f"failed: {reason}" in table and "ggml_abort" not in table  # its words, not a backtrace


def test_peer_errors_are_one_sentence(tiny_gguf, fake_server, tmp_path):
    cases = [
        (["bench", "tiny", "--peer", "vllm"], "--peer runs llama-server beside dflash, not 'vllm'."),
        (["bench", "tiny", "--peer", "llama-server"], "--peer llama-server runs a GGUF target: 'tiny' is not one"),
        (
            bench_args(tiny_gguf["q8_0"], "--peer", "llama-server", "--temperature", "0.5"),
            "--peer compares greedy outputs",
        ),
        (
            bench_args(tiny_gguf["q8_0"], "--peer", "llama-server", "--peer-binary", tmp_path / "none"),
            f"--peer-binary {tmp_path / 'none'} is not an executable file.",
        ),
    ]
    for args, message in cases:
        result = invoke(*args)
        assert result.exit_code != 0, args
        assert result.stderr.startswith(f"error: {message}"), result.stderr
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_llama_servers_plain_output_is_compared_up_to_dflashs_end_of_sequence():
    """llama-server's ignore_eos bans the end-of-sequence token where dflash's --ignore-eos decodes past it: the two
    plain outputs are compared up to dflash's first end of sequence (cut by bench), the rest of llama-server's not."""
    from dflash_local.cli.bench import _until
    from dflash_local.peer import _summarise

    rows = [{"ids": ids, "decode_tokens_per_s": 1.0, "tau": 0.0} for ids in ([5, 6, 7, 8], [5, 6, 9, 9], [5, 6])]
    reference = [_until(ids, frozenset({1})) for ids in ([5, 6, 1, 4], [5, 6, 7, 8], [5, 7])]
    assert reference == [[5, 6], [5, 6, 7, 8], [5, 7]]
    modes = _summarise({"plain": {"error": None, "prompts": rows}}, reference)
    assert modes["plain"]["identical_to_dflash_plain"] == 1
