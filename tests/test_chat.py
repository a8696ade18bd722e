"""`dflash chat tiny` driven through a pseudo-terminal, as a plain pipe, and in-process (history, Ctrl-C)."""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pexpect
import pytest
from in_process import invoke
from rich.console import Console
from test_chat_template import QWEN3_LIKE

from dflash_local import chat as chat_module
from dflash_local import generation
from dflash_local.chat import Chat, piped_lines
from dflash_local.decode import Settings, Step, run
from dflash_local.defaults import CACHE_RAM_MIB
from dflash_local.errors import DFlashError
from dflash_local.generation import load_models
from dflash_local.reasoning import ANSWER, TAG, THINKING
from dflash_local.reply.channels import THINK, ReplyReader
from dflash_local.reply.text_stream import TextStream
from dflash_local.runtime import LoadSpec, RuntimeConfig
from dflash_local.tokenizer import TextTokenizer


def child_env() -> dict[str, str]:
    """The chat processes' environment, read when they start (after conftest points DFLASH_HOME at the session)."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "TERM": "xterm", "COLUMNS": "120"}


PROMPT = ">>> "
TINY = Path(__file__).resolve().parent.parent / "models" / "tiny"
LONG = "Please explain " + "the whole history of every programming language ever made, " * 20
CSI = re.compile(r"\x1b\[([0-9;?]*)([A-Za-z])")


def spawn(*args: str, rows: int = 24, cols: int = 120, sigint_ignored: bool = False) -> pexpect.spawn:
    child = pexpect.spawn(
        sys.executable,
        ["-m", "dflash_local", "chat", "tiny", *args],
        env={**child_env(), "COLUMNS": str(cols)},
        encoding="utf-8",
        timeout=120,
        dimensions=(rows, cols),
        preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint_ignored else None,
    )
    child.expect_exact(PROMPT)
    return child


def pipe(text: str | bytes, *args: str) -> subprocess.CompletedProcess:
    data = text.encode() if isinstance(text, str) else text
    result = subprocess.run(
        [sys.executable, "-m", "dflash_local", "chat", "tiny", *args],
        input=data,
        capture_output=True,
        env=child_env(),
        timeout=120,
    )
    result.stdout, result.stderr = result.stdout.decode(), result.stderr.decode()
    return result


def terminal_states(raw: str, rows: int, cols: int) -> Iterator[list[str]]:
    """What a rows x cols terminal holds (scrollback, then screen) as `raw` is written: one state each time rich
    starts redrawing its live region ("\\r" + erase line), and the final one. Enough of xterm for rich and input();
    the cursor cannot move above the screen's top row, so rows that scrolled away can no longer be erased.
    """
    lines, top, row, col, i = [""], 0, 0, 0, 0
    while i < len(raw):
        match = CSI.match(raw, i)
        if match:
            if match[0] == "\x1b[2K" and raw[i - 1] == "\r":
                yield list(lines)
            count = int(match[1]) if match[1].isdigit() else 1
            if match[2] == "A":
                row = max(top, row - count)
            elif match[2] == "G":
                col = count - 1
            elif match[2] == "K":
                lines[row] = "" if match[1] == "2" else lines[row][:col]
            i = match.end()
            continue
        char, i = raw[i], i + 1
        if char == "\r":
            col = 0
        elif char == "\n" or " " <= char != "\x7f":
            if char == "\n" or col >= cols:  # a line feed, or the deferred wrap past the last column
                row, col = row + 1, 0
                lines += [""] * (row == len(lines))
                top = max(top, row - rows + 1)
            if char != "\n":
                line = lines[row].ljust(col)
                lines[row], col = line[:col] + char + line[col + 1 :], col + 1
    yield lines


@pytest.fixture(scope="module")
def models():
    return load_models(TINY / "target", TINY / "drafter", LoadSpec(RuntimeConfig(device="cpu"), max_context=96))


def piped_chat(models, max_new_tokens: int = 8) -> Chat:
    """A chat writing answers and notes to strings, as it does on a pipe."""
    settings = Settings(max_new_tokens=max_new_tokens, stop_ids=models.stop_ids, draft=True)
    return Chat(
        models, settings, Console(file=io.StringIO(), soft_wrap=True), Console(file=io.StringIO(), soft_wrap=True)
    )


def notes(chat: Chat) -> list[str]:
    return chat.notes.file.getvalue().splitlines()


def test_chat_streams_with_status_and_commands():
    child = spawn("--max-new-tokens", "40")
    child.sendline("Write a Python function `clamp(x, lo, hi)` that clamps x.")
    child.expect(r"tok/s")
    child.expect(r"tau \d+\.\d\d")
    child.expect_exact(PROMPT)
    child.sendline("/stats")
    child.expect("acceptance histogram")
    child.sendline("/reset")
    child.expect_exact("(conversation cleared)")
    child.sendline("/draft off")
    child.expect_exact("(drafting off)")
    child.sendline("/quit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


@pytest.mark.parametrize("launcher", ["plain", "ignoring SIGINT"])
def test_ctrl_c_stops_the_answer_not_the_program(launcher):
    # a launcher that ignores SIGINT (nohup, a background job, some CI runners) passes that on to the chat
    child = spawn("--max-new-tokens", "1500", "--ignore-eos", sigint_ignored=launcher != "plain")
    child.sendline("def fibonacci(n):")
    child.expect(r"tok/s")  # the answer is streaming
    child.sendintr()
    child.expect_exact("(stopped)")
    child.expect_exact(PROMPT)
    child.sendline("/quit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_chat_as_a_pipe_answers_on_stdout_and_fails_when_the_last_line_failed():
    lines = "Explain what `os.path.join` does.\n/unknown\n/temp nan\n/temp inf\n/temp -1\n/draft maybe\n"
    result = pipe(lines, "--max-new-tokens", "16")
    assert result.returncode == 1
    assert result.stdout.strip() and "/unknown" not in result.stdout  # the answer only: every error on stderr
    status, *errors = result.stderr.splitlines()
    assert re.fullmatch(r"\d+ tok · [\d.]+ tok/s · tau [\d.]+ · k \d+ [█·]+ · draft \d+% / target · on cpu", status)
    assert errors == [
        "error: Unknown command /unknown; /help lists them.",
        "error: The temperature must be a finite number, 0 or more, got nan.",
        "error: The temperature must be a finite number, 0 or more, got inf.",
        "error: The temperature must be a finite number, 0 or more, got -1.0.",
        "error: Use /draft on or /draft off.",
    ]


def test_unknown_model_suggests_close_names():
    result = invoke("chat", "tinyy")
    assert isinstance(result.exception, SystemExit) and result.exit_code == 1, repr(result.exception)
    assert result.stderr.strip() == (
        "error: 'tinyy' is neither a known model, a Hub repo (owner/name) nor a path. Did you mean tiny?"
    )


def test_cache_ram_gives_the_chat_a_prompt_cache_in_host_ram(monkeypatch):
    """chat --cache-ram MIB, as serve's: the session keeps other prefixes' saved states within that budget (default
    defaults.CACHE_RAM_MIB, 0 none), and /stats says what it holds; a negative budget is one error line."""
    caches = []
    monkeypatch.setattr(chat_module, "run_chat", lambda models, settings, **_: caches.append(models))
    for args in (("--cache-ram", "8", "--device", "cpu"), (), ("--cache-ram", "0")):
        result = invoke("chat", "tiny", *args)
        assert result.exit_code == 0, result.stderr
        if args[1:] == ("8", "--device", "cpu"):  # a device named: the load's placed line, with the budget
            assert (
                "placed: target on cpu" in result.stderr and "; prompt cache up to 8 MiB of host RAM\n" in result.stderr
            )
    budgets = [None if m.session.cache is None else m.session.cache.budget for m in caches]
    assert budgets == [8 * 2**20, CACHE_RAM_MIB * 2**20, None]
    chat = piped_chat(caches[0], 4)
    chat.answer("Hi")
    assert "\nprompt cache: 0 saved prompts, 0 of 8 MiB of host RAM" in chat.stats_text()
    result = invoke("chat", "tiny", "--cache-ram", "-1")
    assert (result.exit_code, result.stderr) == (1, "error: --cache-ram must be 0 (off) or more MiB, got -1.\n")


def test_a_path_that_is_not_a_model():
    readme = Path(__file__).resolve().parent.parent / "README.md"
    result = invoke("chat", readme)
    assert isinstance(result.exception, SystemExit) and result.exit_code == 1, repr(result.exception)
    expected = f"error: {readme} is neither a model folder (config.json + safetensors) nor a .gguf file."
    assert result.stderr.strip() == expected


def test_a_long_answer_reaches_a_small_terminal_whole_and_once():
    args, message = ("--max-new-tokens", "200", "--ignore-eos", "--max-context", "512"), "def fibonacci(n):"
    models = load_models(TINY / "target", TINY / "drafter", LoadSpec(RuntimeConfig(device="cpu"), max_context=512))
    ids = models.tokenizer.encode_chat([{"role": "user", "content": message}])
    new_ids, _ = run(models.target, models.drafter, ids, Settings(max_new_tokens=200))
    answer = "".join(models.tokenizer.decode([t for t in new_ids if t not in models.stop_ids]).split())
    child = spawn(*args, rows=20, cols=40)
    child.sendline(message)
    child.expect_exact(PROMPT)
    states = list(terminal_states(child.before, rows=20, cols=40))
    for lines in states:  # while streaming: the newest text and the status line are on screen, nothing twice
        while not lines[-1]:
            lines.pop()
        status = [n for n, line in enumerate(lines) if re.match(r"\d+ tok · ", line)]
        assert lines[0] == message and status[-1] >= len(lines) - 3, lines[-20:]  # the status (wrapped in 3 rows)
        assert answer.startswith("".join("".join(lines[1 : status[-1]]).split())), lines
    assert status[-1] > 20 and "".join("".join(lines[1 : status[-1]]).split()) == answer
    child.sendline(LONG)  # too long for the context: one line, and the session goes on
    child.expect(r"error: This message is \d+ tokens, and the 512-token context keeps 200 for the answer;")
    child.expect_exact(PROMPT)
    child.sendline("/quit")
    child.expect(pexpect.EOF)


def test_a_rejected_message_leaves_the_history_as_it_was(models):
    chat = piped_chat(models)
    chat.answer("Write a function that adds two numbers.")
    before = [dict(message) for message in chat.state.messages]
    assert [m["role"] for m in before] == ["user", "assistant"] and before[1]["content"]
    tokens = len(models.tokenizer.encode_chat([{"role": "user", "content": LONG}]))
    with pytest.raises(DFlashError) as caught:
        chat.answer(LONG)
    assert str(caught.value) == (
        f"This message is {tokens} tokens, and the 96-token context keeps 8 for the answer; send a shorter one."
    )
    assert chat.state.messages == before
    chat.answer("Now subtract them.")
    assert chat.state.messages[:2] == before and chat.state.messages[2]["content"] == "Now subtract them."
    assert not [line for line in notes(chat) if "context full" in line]


def test_old_turns_are_dropped_only_to_fit_a_message_that_fits(models):
    chat = piped_chat(models, max_new_tokens=24)
    for text in ("Write a function that adds two numbers.", "Now subtract them.", "And multiply?"):
        chat.answer(text)
    assert "(context full: dropped the oldest 1 turn)" in notes(chat)
    assert [m["content"] for m in chat.state.messages[::2]] == ["Now subtract them.", "And multiply?"]


def test_a_template_error_is_one_line_and_the_history_survives(models):
    template = "{% if messages[-1]['content'] == 'boom' %}{{ raise_exception('boom') }}{% endif %}"
    config = {**models.tokenizer.config, "chat_template": template + models.tokenizer.config["chat_template"]}
    chat = piped_chat(replace(models, tokenizer=TextTokenizer(models.tokenizer.tokenizer, config)))
    assert chat_module._turn(chat, "hi") is False
    before = [dict(message) for message in chat.state.messages]
    assert chat_module._turn(chat, "boom") is True
    assert notes(chat)[-1] == "error: The chat template failed to render: boom."
    assert chat.state.messages == before
    assert chat_module._turn(chat, "hello") is False
    assert chat.state.messages[:2] == before and len(chat.state.messages) == 4


def interrupt_after(calls: int, function):
    """`function`, raising KeyboardInterrupt (as Ctrl-C does) on its call number `calls`."""
    count = [0]

    def wrapped(*args, **kwargs):
        count[0] += 1
        if count[0] == calls:
            raise KeyboardInterrupt
        return function(*args, **kwargs)

    return wrapped


@pytest.mark.parametrize("where", ["rendering", "prefill"])
def test_ctrl_c_before_the_answer_starts_leaves_no_trace(models, monkeypatch, where):
    chat = piped_chat(models)
    chat.answer("Write a function that adds two numbers.")
    before = [dict(message) for message in chat.state.messages]
    if where == "rendering":
        monkeypatch.setattr(models.tokenizer, "encode_chat", interrupt_after(1, models.tokenizer.encode_chat))
    else:
        monkeypatch.setattr(models.target, "forward", interrupt_after(1, models.target.forward))
    assert chat_module._turn(chat, "Now subtract them.") is False
    assert notes(chat)[-1] == "(stopped)"
    assert chat.state.messages == before
    monkeypatch.undo()
    chat.answer("Now subtract them.")
    assert chat.state.messages[:2] == before and len(chat.state.messages) == 4


def test_ctrl_c_while_decoding_keeps_the_partial_answer(models, monkeypatch):
    chat = piped_chat(models, max_new_tokens=40)
    monkeypatch.setattr(models.target, "forward", interrupt_after(3, models.target.forward))
    assert chat_module._turn(chat, "Write a function that adds two numbers.") is False
    assert notes(chat)[-1] == "(stopped)"
    answer = chat.state.messages[1]["content"]
    assert answer and chat.console.file.getvalue() == answer + "\n"


def test_the_stop_token_never_shows_even_past_it(models):
    settings, message = Settings(max_new_tokens=40, stop_ids=frozenset()), "Write a function that adds two numbers."
    chat = piped_chat(models)
    chat.state.settings = settings  # as --ignore-eos sets it
    chat.answer(message)
    ids = models.tokenizer.encode_chat([{"role": "user", "content": message}])
    new_ids, _ = run(models.target, models.drafter, ids, settings)
    stop = models.tokenizer.token_id("<|end|>")
    assert stop in models.stop_ids and stop in new_ids[:-1]  # the answer went on past the stop token
    shown = chat.console.file.getvalue()
    assert "<|end|>" not in shown and shown == chat.state.messages[1]["content"] + "\n"
    assert shown[:-1] == models.tokenizer.decode([t for t in new_ids if t not in models.stop_ids])


def test_a_piped_line_that_is_not_utf8_is_answered_with_replacement_characters():
    assert list(piped_lines(io.BytesIO(b"caf\xe9\n\xff\xfe ok\n"))) == ["caf\ufffd\n", "\ufffd\ufffd ok\n"]
    result = pipe(b"/draft maybe\ncaf\xe9 au lait?\n", "--max-new-tokens", "4")
    assert result.returncode == 0, result.stderr  # the failed line was not the last
    error, status = result.stderr.splitlines()
    assert error == "error: Use /draft on or /draft off." and status.startswith("4 tok · ")
    assert len(result.stdout.splitlines()) == 1


THOUGHT = "<think>\nThey want a sum.\n</think>\n\n"


def scripted_chat(models, monkeypatch, answer: str, thinking: bool | None, terminal: bool = False) -> tuple:
    """A chat over a Qwen3-like template whose model answers `answer` (a few ids per step); returns the chat and
    the prompts it rendered, as text."""
    config = {**models.tokenizer.config, "chat_template": QWEN3_LIKE}
    tokenizer = TextTokenizer(models.tokenizer.tokenizer, config)
    ids, prompts = tokenizer.encode(answer, add_special_tokens=False), []

    def answering(target, drafter, prompt_ids, settings, policy=None, session=None):
        prompts.append(tokenizer.decode(prompt_ids))
        for start in range(0, len(ids), 3):
            yield Step(ids[start : start + 3], None if start == 0 else 3, 0.0, 0.0, 4)

    monkeypatch.setattr(generation, "generate", answering)
    settings = Settings(max_new_tokens=8, stop_ids=models.stop_ids)  # the fake answer ignores the limit
    out = Console(file=io.StringIO(), force_terminal=terminal, width=60, soft_wrap=not terminal)
    chat = Chat(replace(models, tokenizer=tokenizer), settings, out, Console(file=io.StringIO()), thinking=thinking)
    return chat, prompts


def test_thinking_follows_the_catalog_and_think_switches_it(models, monkeypatch):
    chat, prompts = scripted_chat(models, monkeypatch, "Use a + b.", thinking=False)
    chat.answer("Add two numbers.")
    assert prompts[-1].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert "think off" in chat.stats_text() and chat.state.messages[-1]["content"] == "Use a + b."
    assert chat_module._turn(chat, "/think maybe") is True and notes(chat)[-1] == "error: Use /think on or /think off."
    assert chat.command("/think on") and chat.state.thinking is True
    chat.answer("And subtract?")
    assert prompts[-1].endswith("<|im_start|>user\nAnd subtract?<|im_end|>\n<|im_start|>assistant\n")
    assert "think on" in chat.stats_text()
    plain = piped_chat(models)  # the tiny template has no switch: no mode in the status, /think refused
    assert plain.state.thinking is None and chat_module._turn(plain, "/think on") is True
    assert notes(plain)[-1] == "error: This model's chat template has no thinking switch."


def test_thinking_is_dimmed_and_kept_out_of_the_history(models, monkeypatch):
    chat, prompts = scripted_chat(models, monkeypatch, THOUGHT + "Use a + b.", thinking=None)
    assert chat.state.thinking is True  # the template's own default
    chat.answer("Add two numbers.")
    assert chat.console.file.getvalue() == THOUGHT + "Use a + b.\n"  # a pipe gets the exact text
    assert chat.state.messages[-1] == {"role": "assistant", "content": "Use a + b."}
    chat.answer("And subtract?")
    assert "<|im_start|>assistant\nUse a + b.<|im_end|>\n<|im_start|>user\nAnd subtract?" in prompts[-1]
    shown, _ = scripted_chat(models, monkeypatch, THOUGHT + "Use a + b.", thinking=True, terminal=True)
    shown.answer("Add two numbers.")
    screen = shown.console.file.getvalue().replace("\x1b[0m\x1b[2m", "")  # joins adjacent dim runs
    assert "\x1b[2mThey want a sum.\x1b[0m" in screen and "\x1b[2m</think>\x1b[0m" in screen
    assert "Use a + b." in screen and "\x1b[2mUse" not in screen


def test_tags_split_across_deltas():
    text = THOUGHT + "Use <b> a + b.<thi"
    reply = TextStream(None, frozenset(), reader=ReplyReader(THINK, None))  # text in: no tokenizer
    parts = [reply.add_text(text[n : n + 2]) for n in range(0, len(text), 2)] + [reply.finish(None)[0]]
    pieces = [piece for part in parts for piece in part.pieces]
    assert "".join(p for p, _ in pieces) == text
    assert "".join(p for p, kind in pieces if kind != ANSWER) == "<think>\nThey want a sum.\n</think>\n\n"
    assert "".join(p for p, kind in pieces if kind == ANSWER) == "Use <b> a + b.<thi"
    opened = TextStream(None, frozenset(), reader=ReplyReader(THINK, None, inside=True))  # the prompt opened it
    assert opened.add_text("hmm</think>\n\nok").pieces == [
        *(("hmm", THINKING), ("</think>", TAG), ("\n\n", TAG), ("ok", ANSWER))
    ]


def test_the_catalog_says_how_the_drafter_thinks(tmp_path, monkeypatch):
    from dflash_local.catalog import load_catalog, resolve

    assert load_catalog()["qwen3-8b-q4"].thinking is False and load_catalog()["tiny"].thinking is None
    (tmp_path / "t").mkdir(), (tmp_path / "d").mkdir()
    catalog = tmp_path / "catalog.toml"
    catalog.write_text('[mine]\ntarget = "bundled:t"\ndrafter = "bundled:d"\nthinking = false\n')
    monkeypatch.setenv("DFLASH_CATALOG", str(catalog))
    assert resolve("mine", None, None).thinking is False
    assert resolve("mine", str(tmp_path / "d"), None).thinking is None  # another drafter: unknown
    catalog.write_text('[mine]\ntarget = "bundled:t"\nthinking = "no"\n')
    with pytest.raises(DFlashError, match=r"entry 'mine': thinking must be true or false, got 'no'\.$"):
        load_catalog()
