"""Rendering a model's Jinja chat template in a sandbox (templates come from model repos: never trusted)."""

from __future__ import annotations

from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import DFlashError


def _raise(message: str) -> None:
    raise TemplateError(message)


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


def render_chat(
    tokenizer_config: dict[str, Any], messages: list[dict[str, str]], add_generation_prompt: bool = True
) -> str:
    """Render messages with the config's chat template, as transformers would."""
    source = template_source(tokenizer_config)
    if source is None:
        raise DFlashError("The model has no chat template (tokenizer_config.json has no chat_template).")
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    try:
        return env.from_string(source).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=_token_text(tokenizer_config.get("bos_token")),
            eos_token=_token_text(tokenizer_config.get("eos_token")),
        )
    except TemplateError as exc:
        raise DFlashError(f"The chat template failed to render: {exc}.") from None
