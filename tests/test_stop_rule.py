"""The one stop rule, in `dflash chat` and `dflash serve` alike (reply/text_stream.py): an end-of-turn marker that the
model spells as text ends the answer there, as its stop token would; past stop tokens (--ignore-eos, ignore_eos)
neither the spelled marker nor the stop token's text ends it, and a stop token's text never shows."""

from __future__ import annotations

import io

import openai
import pytest
from rich.console import Console
from test_serve_clients import KEY, TINY, serving

from dflash_local import generation
from dflash_local.chat import Chat
from dflash_local.decode import Settings, Step
from dflash_local.runtime import LoadSpec, RuntimeConfig
from dflash_local.server.engine import Engine

BEFORE, AFTER = "Sure, 1 + 1 = 2.", " And more."


@pytest.fixture(scope="module")
def models():
    return generation.load_models(TINY / "target", None, LoadSpec(RuntimeConfig(device="cpu")), auto_block=False)


@pytest.fixture
def answering(models, monkeypatch):
    """The pair's loop replaced by one writing `BEFORE`, then `middle`'s ids, then `AFTER` (a few ids per step)."""

    def script(middle: list[int]) -> None:
        encode = models.tokenizer.encode
        ids = encode(BEFORE, add_special_tokens=False) + middle + encode(AFTER, add_special_tokens=False)

        def generate(target, drafter, prompt_ids, settings, policy=None, session=None):
            for start in range(0, len(ids), 3):
                yield Step(ids[start : start + 3], None if start == 0 else 3, 0.0, 0.0, 4)

        monkeypatch.setattr(generation, "generate", generate)

    return script


def spelled(models) -> list[int]:
    """The tiny pair's end-of-turn marker `<|end|>` written as text: ids that are no stop token."""
    ids = models.tokenizer.encode("<", add_special_tokens=False) + models.tokenizer.encode("|end|>")
    assert models.tokenizer.decode(ids) == "<|end|>" and not set(ids) & models.stop_ids
    return ids


def chat_answer(models, ignore_eos: bool) -> tuple[str, str]:
    """What a piped chat shows of one answer, and what its history keeps."""
    settings = Settings(max_new_tokens=64, stop_ids=frozenset() if ignore_eos else models.stop_ids)
    chat = Chat(models, settings, Console(file=io.StringIO(), soft_wrap=True), Console(file=io.StringIO()))
    chat.answer("Add one and one.")
    return chat.console.file.getvalue(), chat.state.messages[-1]["content"]


def served_answers(models, ignore_eos: bool) -> list[str]:
    """The answer a served chat completion gives, whole and streamed."""
    with serving(Engine(models, 4, None, size=2)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)
        ask = {"model": "tiny", "messages": [{"role": "user", "content": "Add one and one."}], "max_tokens": 64}
        ask["extra_body"] = {"ignore_eos": ignore_eos}
        whole = client.chat.completions.create(**ask).choices[0]
        chunks = list(client.chat.completions.create(**ask, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasons = {whole.finish_reason, next(c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason)}
    assert reasons == {"stop" if not ignore_eos else "length"}
    return [whole.message.content, streamed]


def test_a_spelled_end_of_turn_marker_ends_a_chat_and_a_served_answer_alike(models, answering):
    answering(spelled(models))
    assert chat_answer(models, ignore_eos=False) == (BEFORE + "\n", BEFORE)
    assert served_answers(models, ignore_eos=False) == [BEFORE, BEFORE]


def test_past_stop_tokens_nothing_ends_the_answer_and_no_stop_token_shows(models, answering):
    answering(spelled(models) + [min(models.stop_ids)])  # the marker spelled, then a stop token
    text = BEFORE + "<|end|>" + AFTER
    assert chat_answer(models, ignore_eos=True) == (text + "\n", text)
    assert served_answers(models, ignore_eos=True) == [text, text]
