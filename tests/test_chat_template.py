"""Chat templates are untrusted code: escapes, errors, endless loops and huge outputs each end in one sentence."""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path

import pytest

from dflash_local import chat_template
from dflash_local.chat_template import render_chat
from dflash_local.errors import DFlashError

TINY_CONFIG = json.loads((Path(__file__).parent.parent / "models/tiny/target/tokenizer_config.json").read_text())
MESSAGES = [{"role": "user", "content": "hi"}]
FAILED = "The chat template failed to render: "


def render(source: str) -> str:
    return render_chat({"chat_template": source}, MESSAGES)


def test_the_tiny_template_renders():
    messages = [*MESSAGES, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "bye"}]
    assert (
        render_chat(TINY_CONFIG, messages)
        == "<|user|>hi<|end|><|assistant|>hello<|end|><|user|>bye<|end|><|assistant|>"
    )


@pytest.mark.parametrize(
    "source, message",
    [
        ("{{ ''.__class__.__mro__ }}", FAILED + "access to attribute '__class__' of 'str' object is unsafe."),
        ("{{ cycler.__init__.__globals__ }}", FAILED + "access to attribute '__init__' of 'type' object is unsafe."),
        ("{{ messages.append(messages) }}", FAILED + "access to attribute 'append' of 'list' object is unsafe."),
        ("{{ raise_exception('Only user and assistant roles are supported.') }}",
         FAILED + "Only user and assistant roles are supported."),
        ("{{ 1 / 0 }}", FAILED + "division by zero."),
        ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", FAILED + "it recurses without end."),
        ("{% for i in range(10**9) %}{% endfor %}",
         FAILED + "Range too big; The sandbox blocks ranges larger than MAX_RANGE (100000)."),
        ("{{ 'x' * 10**9 }}", FAILED + "repeating a sequence 1000000000 times makes it longer than 1000000 items."),
        ("{{ [0] * 2000000 }}", FAILED + "repeating a sequence 2000000 times makes it longer than 1000000 items."),
        ("{{ 3 ** 100000000 }}", FAILED + "3 ** 100000000 is too large."),
        ("{% set ns = namespace(x=3) %}{% for i in range(40) %}{% set ns.x = ns.x * ns.x %}{% endfor %}",
         FAILED + "an integer product is too large."),
        ("{{ 'x'|center(4000000000) }}", "The chat template needs more than 512 MB of memory."),
        ("{{ ('\t' * 1000000).expandtabs(100000) }}", "The chat template needs more than 512 MB of memory."),
        ("{% for i in range(1000) %}{% for j in range(1000) %}0123456789{% endfor %}{% endfor %}",
         "The chat template renders more than 1000000 characters."),
        ("{% for %}", FAILED + "Expected an expression, got 'end of statement block'."),
    ],
)  # fmt: skip
def test_a_bad_template_is_one_sentence(source, message):
    with pytest.raises(DFlashError) as caught:
        render(source)
    assert str(caught.value) == message


@pytest.mark.parametrize(
    "source",
    [
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "{% set s = 'x' * 1000000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}",
        "{{ lipsum(10**6) }}",
    ],
)
def test_a_slow_template_is_stopped(monkeypatch, source):
    monkeypatch.setattr(chat_template, "RENDER_SECONDS", 0.2)
    with pytest.raises(DFlashError) as caught:
        render(source)
    assert str(caught.value) == "The chat template took more than 0.2 s to render."


def test_the_process_is_healthy_after_failures():
    limits, tracer = resource.getrlimit(resource.RLIMIT_AS), sys.gettrace()
    for source in (
        "{{ 'x'|center(4000000000) }}",
        "{{ 1 / 0 }}",
        "{% for i in range(2) %}{{ 'x' * 999999 }}{% endfor %}",
    ):
        with pytest.raises(DFlashError):
            render(source)
    assert resource.getrlimit(resource.RLIMIT_AS) == limits
    assert sys.gettrace() is tracer
    assert len(bytearray(chat_template.RENDER_MEMORY + 2**26)) > chat_template.RENDER_MEMORY  # no cap left
    assert render_chat(TINY_CONFIG, MESSAGES) == "<|user|>hi<|end|><|assistant|>"


class CtrlC(dict):
    """A message that is interrupted (as by Ctrl-C) while the template reads it."""

    def __getitem__(self, key):
        raise KeyboardInterrupt


def test_ctrl_c_while_rendering_propagates_and_leaves_no_limits_behind():
    limits, tracer = resource.getrlimit(resource.RLIMIT_AS), sys.gettrace()
    with pytest.raises(KeyboardInterrupt):
        render_chat(TINY_CONFIG, [CtrlC()])
    assert resource.getrlimit(resource.RLIMIT_AS) == limits and sys.gettrace() is tracer
    assert render_chat(TINY_CONFIG, MESSAGES) == "<|user|>hi<|end|><|assistant|>"


QWEN3_LIKE = (
    "{% for m in messages %}{% set content = m.content %}"
    "{% if m.role == 'assistant' and '</think>' in content %}"
    "{% set content = content.split('</think>')[-1].lstrip('\\n') %}{% endif %}"
    "<|im_start|>{{ m.role }}\n{{ content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def test_enable_thinking_reaches_templates_that_read_it():
    config = {"chat_template": QWEN3_LIKE}
    off = render_chat(config, MESSAGES, enable_thinking=False)
    assert off == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert render_chat(config, MESSAGES, enable_thinking=True) == render_chat(config, MESSAGES) == off[:-19]
    assert chat_template.uses_thinking(config) and not chat_template.uses_thinking(TINY_CONFIG)
    assert render_chat(TINY_CONFIG, MESSAGES, enable_thinking=False) == "<|user|>hi<|end|><|assistant|>"


def test_chat_template_names_a_built_in_or_a_jinja_file_and_refuses_the_rest(tmp_path):
    assert chat_template.read_template("chatml") == chat_template.CHATML
    assert render("{{ x }}") == ""  # (a file's text renders the same way as the model's own)
    good = tmp_path / "mine.jinja"
    good.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    assert render_chat({"chat_template": chat_template.read_template(str(good))}, MESSAGES) == "[user] hi\n"
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}")
    with pytest.raises(DFlashError, match=rf"^--chat-template {broken} is not a Jinja template \(.*\)\.$"):
        chat_template.read_template(str(broken))
    with pytest.raises(DFlashError, match=r"^--chat-template must be chatml or a Jinja file, and chatmI is neither\.$"):
        chat_template.read_template("chatmI")
    huge = tmp_path / "huge.jinja"
    huge.write_text("x" * (chat_template.MAX_TEMPLATE_BYTES + 1))
    with pytest.raises(DFlashError, match=r"is over 1 MB: not a chat template\.$"):
        chat_template.read_template(str(huge))


def test_chatml_renders_as_chatml_models_expect():
    messages = [{"role": "system", "content": "Be brief."}, *MESSAGES]
    assert render_chat({"chat_template": chat_template.CHATML}, messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_the_no_template_error_names_the_file_looked_in(tmp_path):
    gguf, folder = tmp_path / "base.gguf", tmp_path / "model"
    for model, named in ((gguf, str(gguf)), (folder, str(folder / "tokenizer_config.json"))):
        config = chat_template.use_template({"bos_token": "<s>"}, None, model)
        with pytest.raises(DFlashError, match=rf"^The model has no chat template \({named} has none\): give one with"):
            render_chat(config, MESSAGES)
        assert chat_template.use_template(config, "T", model)["chat_template"] == "T"
