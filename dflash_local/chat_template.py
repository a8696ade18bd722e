"""Rendering a model's Jinja chat template in a sandbox (templates come from model repos: never trusted).

Rendering runs in-process (it happens for every chat turn and every corpus record), under these bounds:
- Escapes: jinja2's ImmutableSandboxedEnvironment refuses `__class__`-style attributes and mutating lists or dicts.
- Time: a trace function (sys.settrace) sees every line of Python the render runs, the template's own code and
  jinja's runtime alike, and stops it past RENDER_SECONDS. A single C-level operation is not interrupted, so:
- Memory: while rendering, the address space may grow by at most RENDER_MEMORY bytes (RLIMIT_AS, on Linux; other
  systems skip this bound), so a huge string or list fails at once with MemoryError instead of filling the machine.
- Arithmetic: `*` and `**` are checked before they run (sandbox binop hooks): a repeated string or list longer than
  MAX_OUTPUT, or an integer product or power past MAX_INT_BITS bits, is refused; a big-integer power is pure C
  work, slow without being big, that neither bound above would stop.
- Output: the text is generated piece by piece, and rendering stops once it passes MAX_OUTPUT characters.
Any failure is one DFlashError sentence.
"""

from __future__ import annotations

import json
import re
import resource
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any

from jinja2 import Template, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import DFlashError

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + "
    "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
BUILT_IN = {"chatml": CHATML}  # --chat-template's names
TURN_ENDS = ("<|im_end|>", "<|im_start|>")  # ChatML's turn markers: stop strings where the model has no such tokens
MAX_TEMPLATE_BYTES = 1 << 20
RENDER_SECONDS = 2.0
RENDER_MEMORY = 512 * 2**20
MAX_OUTPUT = 1_000_000
MAX_INT_BITS = 100_000


class _OutOfTime(BaseException):
    """Raised into the template's code at the deadline; a BaseException, so no `except Exception` in jinja eats it."""


class _Environment(ImmutableSandboxedEnvironment):
    """The sandbox, with `*` and `**` checked before they run."""

    intercepted_binops = frozenset(["*", "**"])

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _check_binop(operator, left, right)
        return super().call_binop(context, operator, left, right)


def _check_binop(operator: str, left: Any, right: Any) -> None:
    """Refuse a repetition or integer arithmetic whose result would be too big to build quickly."""
    ints = isinstance(left, int) and isinstance(right, int)
    if operator == "**" and ints and right > 0 and left.bit_length() * right > MAX_INT_BITS:
        raise TemplateError(f"{left} ** {right} is too large")
    if operator != "*":
        return
    if ints and left.bit_length() + right.bit_length() > MAX_INT_BITS:
        raise TemplateError("an integer product is too large")
    sequence, count = (left, right) if isinstance(right, int) else (right, left)
    if isinstance(sequence, (str, list, tuple)) and isinstance(count, int) and len(sequence) * count > MAX_OUTPUT:
        raise TemplateError(f"repeating a sequence {count} times makes it longer than {MAX_OUTPUT} items")


def _raise(message: str) -> None:
    raise TemplateError(message)


def _strftime_now(form: str) -> str:
    """Today's date and time in a strftime format (templates that write the date, as gpt-oss's, call it)."""
    return time.strftime(form)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """JSON as transformers' templates write it: keys in their order, plain text (jinja's own filter sorts keys and
    returns markup, which HTML-escapes the text it is joined to)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


_ENV = _Environment(trim_blocks=True, lstrip_blocks=True)
_ENV.filters["tojson"] = _tojson
_ENV.globals["raise_exception"] = _raise
_ENV.globals["strftime_now"] = _strftime_now


@lru_cache(maxsize=8)
def _compile(source: str) -> Template:
    return _ENV.from_string(source)


@contextmanager
def _memory_cap() -> Iterator[None]:
    """Let the address space grow by at most RENDER_MEMORY bytes inside the block (Linux only)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[0])
    except OSError:
        yield
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = pages * resource.getpagesize() + RENDER_MEMORY
    for bound in (soft, hard):
        if bound != resource.RLIM_INFINITY:
            limit = min(limit, bound)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    """Raise _OutOfTime into whatever Python code runs in this thread once `seconds` have passed."""
    end = time.monotonic() + seconds

    def trace(frame: Any, event: str, arg: Any) -> Any:
        if time.monotonic() > end:
            raise _OutOfTime
        return trace

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        yield
    finally:
        sys.settrace(previous)
    if time.monotonic() > end:
        raise _OutOfTime


def read_template(choice: str) -> str:
    """--chat-template's template: a built-in's name (chatml), or a Jinja file's text, checked to compile."""
    if choice in BUILT_IN:
        return BUILT_IN[choice]
    path = Path(choice).expanduser()
    names = " or ".join(BUILT_IN)
    if not path.is_file():
        raise DFlashError(f"--chat-template must be {names} or a Jinja file, and {choice} is neither.")
    if path.stat().st_size > MAX_TEMPLATE_BYTES:
        raise DFlashError(f"--chat-template {path} is over {MAX_TEMPLATE_BYTES >> 20} MB: not a chat template.")
    try:
        source = path.read_text(encoding="utf-8")
        _compile(source)
    except (OSError, UnicodeDecodeError) as exc:
        raise DFlashError(f"--chat-template {path} cannot be read ({exc}).") from None
    except TemplateError as exc:
        raise DFlashError(f"--chat-template {path} is not a Jinja template ({exc}).") from None
    return source


def template_source(tokenizer_config: dict[str, Any]) -> str | None:
    """The default chat template string of a tokenizer_config.json, if any."""
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):
        named = {item.get("name"): item.get("template") for item in template if isinstance(item, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


def _token_text(value: Any) -> str:
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return "" if value is None else str(value)


def _generate(source: str, variables: dict[str, Any]) -> str:
    """Compile and render, stopping once the text passes MAX_OUTPUT characters."""
    pieces, size = [], 0
    for piece in _compile(source).generate(**variables):
        size += len(piece)
        if size > MAX_OUTPUT:
            raise DFlashError(f"The chat template renders more than {MAX_OUTPUT} characters.")
        pieces.append(piece)
    return "".join(pieces)


def takes_tools(tokenizer_config: dict[str, Any]) -> bool:
    """Whether the chat template reads `tools` (renders tool definitions itself)."""
    return re.search(r"\btools\b", template_source(tokenizer_config) or "") is not None


def uses_thinking(tokenizer_config: dict[str, Any]) -> bool:
    """Whether the chat template reads `enable_thinking` (Qwen3-style thinking on/off)."""
    return "enable_thinking" in (template_source(tokenizer_config) or "")


def render_chat(
    tokenizer_config: dict[str, Any],
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    enable_thinking: bool | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """Render messages with the config's chat template, as transformers would, within the bounds above;
    enable_thinking and tools, when given, are passed as those template variables (None leaves them out)."""
    source = template_source(tokenizer_config)
    if source is None:
        where = tokenizer_config.get("chat_template_file", "tokenizer_config.json")
        raise DFlashError(
            f"The model has no chat template ({where} has none): give one with --chat-template chatml or "
            "--chat-template FILE.jinja."
        )
    variables = {
        "messages": messages,
        "add_generation_prompt": add_generation_prompt,
        "bos_token": _token_text(tokenizer_config.get("bos_token")),
        "eos_token": _token_text(tokenizer_config.get("eos_token")),
    }
    if enable_thinking is not None:
        variables["enable_thinking"] = enable_thinking
    if tools is not None:
        variables["tools"] = tools
    try:
        with _memory_cap(), _deadline(RENDER_SECONDS):
            return _generate(source, variables)
    except _OutOfTime:
        raise DFlashError(f"The chat template took more than {RENDER_SECONDS:g} s to render.") from None
    except MemoryError:
        raise DFlashError(f"The chat template needs more than {RENDER_MEMORY >> 20} MB of memory.") from None
    except RecursionError:
        raise DFlashError("The chat template failed to render: it recurses without end.") from None
    except DFlashError:
        raise
    except Exception as exc:  # the template is untrusted code: whatever it raises is its failure
        detail = re.sub(r"\.\s+", "; ", " ".join(str(exc).split())).rstrip(".") or type(exc).__name__
        raise DFlashError(f"The chat template failed to render: {detail}.") from None


def use_template(config: dict[str, Any], source: str | None, model: Path) -> dict[str, Any]:
    """A tokenizer config with --chat-template's source in place of the model's own (None: keep it), and the
    file the template comes from (named when there is none): the model's .gguf or tokenizer_config.json."""
    where = str(model) if model.suffix == ".gguf" else str(model / "tokenizer_config.json")
    return config | ({"chat_template": source} if source is not None else {}) | {"chat_template_file": where}


class ChatEncoder:
    """encode_chat for the tokenizers (TextTokenizer, GGUFTokenizer): each has `config` (the chat template's settings)
    and `encode(text, add_special_tokens)`."""

    config: dict[str, Any]

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        enable_thinking: bool | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """Token ids of messages rendered with the model's chat template (with tools, where given)."""
        text = render_chat(self.config, messages, add_generation_prompt, enable_thinking, tools)
        return self.encode(text, add_special_tokens=False)
