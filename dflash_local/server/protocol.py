"""OpenAI request bodies, checked: the generation fields, messages and prompts, and the error shape of a refusal."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass

from starlette.responses import JSONResponse

from ..reply.tool_calls import json_object
from ..sampling import SamplingParams
from ..vision import MEDIA_MARKER

log = logging.getLogger("dflash.serve")

MAX_STOPS = 4
ImageReader = Callable[[object, str], "bytes | str"]  # an image URL and its place -> the image (images.of_url)
IMAGES = "_images"  # a parsed message's images (bytes, or an http(s) URL string), in the order of its markers


class Refused(Exception):
    """A request answered with an HTTP error in the OpenAI shape before it reaches the engine."""

    def __init__(
        self, status: int, message: str, param: str | None = None, close: bool = False, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.param, self.close, self.code = status, param, close, code

    def headers(self) -> dict[str, str] | None:
        """Connection: close where the rest of the request cannot be read."""
        return {"Connection": "close"} if self.close else None

    def response(self) -> JSONResponse:
        """The refusal in OpenAI's error shape."""
        return error_response(self.status, str(self), param=self.param, code=self.code, headers=self.headers())


class BadRequest(Refused):
    """A request the API refuses: HTTP 400 with the OpenAI error shape, naming the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(400, message, param)


def error_response(
    status: int,
    message: str,
    kind: str | None = None,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """OpenAI's error body, {"error": {"message", "type", "param", "code"}}; the type, unless given, is
    invalid_request_error below 500, else server_error."""
    kind = kind or ("invalid_request_error" if status < 500 else "server_error")
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


@dataclass(frozen=True)
class Sampling:
    """The generation fields of a request, checked: the loop's sampling parameters and what only HTTP has (stop
    strings, streaming, usage); the worker makes them the loop's Settings."""

    max_tokens: int | None = None  # None: up to the context (or serve's --max-new-tokens)
    params: SamplingParams = SamplingParams(temperature=1.0)  # OpenAI's default temperature
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    ignore_eos: bool = False
    grammar: str | None = None  # constrained output (server.constrained), compiled by the worker


def number(body: dict, name: str, default: float, low: float, high: float) -> float:
    """body[name] as a number from low to high (default when absent or null)."""
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise BadRequest(f"'{name}' must be a number from {low:g} to {high:g}, got {json.dumps(value)}.", name)
    return float(value)


def whole(body: dict, name: str, low: int, high: int) -> int | None:
    """body[name] as a whole number from low to high, or None when absent or null."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise BadRequest(f"'{name}' must be a whole number from {low} to {high}, got {json.dumps(value)}.", name)
    return value


def flag(body: dict, name: str) -> bool:
    """body[name] as true or false (false when absent or null)."""
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadRequest(f"'{name}' must be true or false, got {json.dumps(value)}.", name)
    return value


def stop_strings(value: object, name: str = "stop") -> tuple[str, ...]:
    """A stop field: one string or a list of up to MAX_STOPS non-empty strings."""
    stops = [value] if isinstance(value, str) else ([] if value is None else value)
    if not isinstance(stops, list) or len(stops) > MAX_STOPS or not all(isinstance(s, str) and s for s in stops):
        raise BadRequest(f"'{name}' must be a string or a list of up to {MAX_STOPS} non-empty strings.", name)
    return tuple(stops)


NO_FUNCTIONS = "send 'tools' instead (the legacy functions API is not served)"
NO_PENALTIES = "the samplers apply no penalties; send 0 or leave it out"
UNSUPPORTED: dict[str, tuple[tuple[object, ...], str]] = {
    "functions": ((None, []), f"'functions' cannot be honoured: {NO_FUNCTIONS}."),
    "function_call": ((None, "none", "auto"), f"'function_call' must be none or auto: {NO_FUNCTIONS}."),
    "n": ((None, 1), "Only n = 1 is supported: the engine decodes one sequence at a time."),
    "best_of": ((None, 1), "Only best_of = 1 is supported: the engine decodes one sequence at a time."),
    "logprobs": ((None, False), "'logprobs' is not supported by dflash serve."),
    "top_logprobs": ((None, 0), "'top_logprobs' is not supported by dflash serve."),
    "echo": ((None, False), "'echo' is not supported by dflash serve."),
    "suffix": ((None, ""), "'suffix' is not supported by dflash serve."),
    "logit_bias": ((None, {}), "'logit_bias' is not supported by dflash serve."),
    "presence_penalty": ((None, 0), f"'presence_penalty' cannot be honoured: {NO_PENALTIES}."),
    "frequency_penalty": ((None, 0), f"'frequency_penalty' cannot be honoured: {NO_PENALTIES}."),
}
# Fields read here or by the endpoints, and those accepted with no effect on one sequence without tools.
KNOWN = {
    "model",
    "messages",
    "tools",
    "prompt",
    "chat_template_kwargs",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "tool_choice",
    "response_format",
}
KNOWN |= {"top_p", "top_k", "seed", "stop", "stream", "stream_options", "ignore_eos", "user", "parallel_tool_calls"}
KNOWN |= set(UNSUPPORTED)


def refuse_unsupported(body: dict) -> None:
    """A 400 naming the first field that asks for what this server cannot do, instead of a 200 that ignores it."""
    for name, (allowed, message) in UNSUPPORTED.items():
        if body.get(name) not in allowed:
            raise BadRequest(message, name)
    for name in ("user", "parallel_tool_calls"):
        if body.get(name) is not None and not isinstance(body[name], str if name == "user" else bool):
            raise BadRequest(f"'{name}' must be {'a string' if name == 'user' else 'true or false'}.", name)
    unknown = sorted(set(body) - KNOWN)
    if unknown:
        log.debug("ignored unknown request fields: %s", ", ".join(unknown))


def parse_sampling(body: dict) -> Sampling:
    """temperature, top_p, top_k, max_tokens (or max_completion_tokens), stop, seed, stream, stream_options,
    ignore_eos; refused and unknown fields as refuse_unsupported says."""
    refuse_unsupported(body)
    limit = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise BadRequest("'stream_options' must be an object.", "stream_options")
    top_k = whole(body, "top_k", -1, 2**31 - 1)
    return Sampling(
        max_tokens=whole(body, limit, 1, 2**31 - 1),
        params=SamplingParams(number(body, "temperature", 1.0, 0.0, 2.0), top_p(body), max(top_k or 0, 0)),
        seed=whole(body, "seed", 0, 2**64 - 1),
        stop=stop_strings(body.get("stop")),
        stream=flag(body, "stream"),
        include_usage=flag(options or {}, "include_usage"),
        ignore_eos=flag(body, "ignore_eos"),
    )


def top_p(body: dict) -> float:
    """top_p: more than 0 and at most 1."""
    value = number(body, "top_p", 1.0, 0.0, 1.0)
    if value == 0:
        raise BadRequest("'top_p' must be more than 0 and at most 1, got 0.", "top_p")
    return value


def _content(message: dict, where: str, images: list | None = None, of_url: ImageReader | None = None) -> str:
    """A message's text: a string, or the text parts of a list of content parts (image_url parts, where images is a
    list, become media markers and their images, read by of_url, go into it)."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        texts = []
        for index, part in enumerate(content):
            if part.get("type") == "image_url" and images is not None and of_url is not None:
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                images.append(of_url(url, f"{where}.content[{index}].image_url"))
                texts.append(MEDIA_MARKER)
            elif part.get("type") == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                raise BadRequest(
                    "Only text content parts are supported (image_url parts in user messages).", f"{where}.content"
                )
        return "".join(texts)
    raise BadRequest("A message's content must be a string or a list of text parts.", f"{where}.content")


def tool_call(call_id: object, name: object, arguments: object, message: str, where: str) -> dict:
    """A tool call as templates take it, whichever API sent it: arguments as an object (transformers' way; JSON text
    is read), or a 400 with message."""
    arguments = json_object(arguments)
    if not isinstance(name, str) or arguments is None:
        raise BadRequest(message, where)
    return {"id": str(call_id), "type": "function", "function": {"name": name, "arguments": arguments}}


def reasoned(turn: dict, reasoning: str) -> dict:
    """An assistant turn with its reasoning under the names templates read (Qwen3's, gpt-oss's), if it has any."""
    if reasoning and turn["role"] == "assistant":
        turn["reasoning_content"] = turn["thinking"] = reasoning
    return turn


def _tool_calls(message: dict, where: str) -> list[dict]:
    """An assistant message's tool calls, each {id, function: {name, arguments (an object, or JSON text)}}."""
    calls = message.get("tool_calls") or []
    if not isinstance(calls, list):
        raise BadRequest("'tool_calls' must be a list.", f"{where}.tool_calls")
    taken = []
    for index, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        function = function if isinstance(function, dict) else {}
        message = "A tool call must be {function: {name, arguments (a JSON object, as text)}}."
        call_id = call.get("id", "") if isinstance(call, dict) else ""
        arguments = function.get("arguments", "{}")
        taken.append(tool_call(call_id, function.get("name"), arguments, message, f"{where}.tool_calls[{index}]"))
    return taken


def parse_messages(body: dict, of_url: ImageReader | None = None) -> list[dict]:
    """The chat messages as the template takes them: content strings, tool calls, reasoning, tool results' ids and
    names; with of_url, a user turn's image_url parts as media markers and their images under IMAGES."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list of {role, content} objects.", "messages")
    parsed = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequest("Each message must be an object with a 'role' string.", where)
        images: list | None = [] if message["role"] == "user" else None  # images only in user turns
        taken = {"role": message["role"], "content": _content(message, where, images, of_url)}
        if images:
            taken[IMAGES] = images
        if message.get("tool_calls"):
            taken["tool_calls"] = _tool_calls(message, where)
        for name in ("tool_call_id", "name"):
            if isinstance(message.get(name), str):
                taken[name] = message[name]
        reasoning = message.get("reasoning_content", message.get("thinking"))  # OpenAI-shape clients', Ollama's
        parsed.append(reasoned(taken, reasoning if isinstance(reasoning, str) else ""))
    return parsed


def parse_thinking(body: dict) -> bool | None:
    """chat_template_kwargs.enable_thinking (as vLLM and SGLang take it), if the request sets it."""
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise BadRequest("'chat_template_kwargs' must be an object.", "chat_template_kwargs")
    thinking = kwargs.get("enable_thinking")
    if thinking is not None and not isinstance(thinking, bool):
        raise BadRequest("'enable_thinking' must be true or false.", "chat_template_kwargs.enable_thinking")
    return thinking


def parse_prompt(body: dict) -> str | list[int]:
    """A completions prompt: text, a list of one text, or token ids (a list of integers, or a list of one)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
        return prompt
    raise BadRequest("'prompt' must be a non-empty string or a list of token ids (one prompt per request).", "prompt")
