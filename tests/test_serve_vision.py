"""`dflash serve --mmproj` with images, driven by the real openai, anthropic and ollama clients against the tiny random
Gemma 3 vision target (tests/tiny_archs.py's gemma3-vision): each API's image shape gives DFlash's answer equal to
plain decoding's, the same image again reuses the caches, and bad images are a 400 in the API's own error shape."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path

import anthropic
import numpy as np
import ollama
import openai
import pytest
from test_architectures import build_tiny
from test_serve_clients import KEY, serving
from tiny_models import make_drafter

from dflash_local.chat_template import read_template, use_template
from dflash_local.generation import load_models
from dflash_local.runtime import LoadSpec, RuntimeConfig
from dflash_local.server.engine import Engine
from dflash_local.vision import MAX_IMAGE_PIXELS, load_projector

SIZE, ROWS = 112, 16  # the tiny tower's image size and rows per image
TOKENS = 12
QUESTION = "What is in this picture?"


def png(seed: int) -> bytes:
    """A seeded random RGB image of the tower's size, as PNG bytes."""
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return build_tiny(tmp_path_factory.mktemp("serve-vision"), "gemma3-vision") / "gemma3-vision"


def engine_of(model: Path, drafter: Path | None) -> Engine:
    """An engine over the tiny vision target (chatml template), with its projector; a drafter at block 4, or plain."""
    models = load_models(model / "model.gguf", drafter, LoadSpec(RuntimeConfig(threads=1), max_context=256), False)
    models.tokenizer.config = use_template(models.tokenizer.config, read_template("chatml"), model / "model.gguf")
    engine = Engine(models, 4 if drafter else 1, None, size=8, no_draft=drafter is None)
    engine.projector = load_projector(models, model / "mmproj.gguf", 1)
    return engine


@pytest.fixture(scope="module")
def urls(model, tmp_path_factory) -> Iterator[dict[str, str]]:
    """Base URLs of two servers: "dflash" (a random block-4 drafter) and "plain" (--no-draft)."""
    drafter = make_drafter(tmp_path_factory.mktemp("serve-vision-drafter") / "d", model / "hf-text", std=0.2)
    with serving(engine_of(model, drafter)) as dflash, serving(engine_of(model, None)) as plain:
        yield {"dflash": dflash, "plain": plain}


def openai_chat(url: str, image: bytes) -> tuple[str, int, int]:
    """An OpenAI chat completion with a data: URL image part: its text, prompt and cached tokens."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
    part = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64(image)}"}}
    content = [{"type": "text", "text": QUESTION}, part]
    answer = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": content}], temperature=0, max_tokens=TOKENS
    )
    usage = answer.usage
    return answer.choices[0].message.content, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens


def responses(url: str, image: bytes) -> tuple[str, int, int]:
    """The Responses API with an input_image."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
    content = [{"type": "input_text", "text": QUESTION}]
    content.append({"type": "input_image", "image_url": f"data:image/png;base64,{b64(image)}"})
    answer = client.responses.create(
        model="tiny", input=[{"role": "user", "content": content}], temperature=0, max_output_tokens=TOKENS
    )
    usage = answer.usage
    return answer.output_text, usage.input_tokens, usage.input_tokens_details.cached_tokens


def messages(url: str, image: bytes) -> tuple[str, int, int]:
    """Anthropic's Messages API with a base64 image block."""
    client = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0, timeout=120)
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64(image)}}
    answer = client.messages.create(
        model="tiny",
        max_tokens=TOKENS,
        extra_body={"temperature": 0},
        messages=[{"role": "user", "content": [block, {"type": "text", "text": QUESTION}]}],
    )
    usage = answer.usage
    read = usage.cache_read_input_tokens or 0
    return "".join(b.text for b in answer.content if b.type == "text"), usage.input_tokens + read, read


def ollama_chat(url: str, image: bytes) -> tuple[str, int, int]:
    """Ollama's /api/chat with images (the client sends them base64)."""
    client = ollama.Client(host=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
    message = {"role": "user", "content": QUESTION, "images": [image]}
    answer = client.chat("tiny", messages=[message], options={"temperature": 0, "num_predict": TOKENS})
    return answer.message.content, answer.prompt_eval_count, -1


def ollama_generate(url: str, image: bytes) -> tuple[str, int, int]:
    """Ollama's /api/generate with images."""
    client = ollama.Client(host=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
    answer = client.generate("tiny", QUESTION, images=[image], options={"temperature": 0, "num_predict": TOKENS})
    return answer.response, answer.prompt_eval_count, -1


APIS = {"openai": openai_chat, "responses": responses, "anthropic": messages, "ollama-chat": ollama_chat}
APIS["ollama-generate"] = ollama_generate


@pytest.mark.parametrize("api", list(APIS))
def test_an_image_in_each_api_answers_as_plain_decoding_and_is_reused(urls, api):
    """T=0: DFlash's answer with the image equals --no-draft's; the same image again reuses all but the prompt's
    last token where the API reports cached tokens; another image answers otherwise."""
    ask = APIS[api]
    text, prompt, _ = ask(urls["dflash"], png(0))
    assert text and prompt > ROWS
    assert ask(urls["plain"], png(0))[0] == text
    again = ask(urls["dflash"], png(0))
    assert again[0] == text
    if again[2] >= 0:
        assert again[2] == prompt - 1, again
    other = ask(urls["dflash"], png(1))
    assert other[0] == ask(urls["plain"], png(1))[0]
    if other[2] >= 0:
        assert other[2] < prompt - ROWS, other  # the text before the image at most: never the other image's rows


def bad_images() -> dict[str, tuple[str, str]]:
    """Data URLs the server refuses, and words of each refusal."""
    good = png(0)
    side = int(MAX_IMAGE_PIXELS**0.5) + 1
    huge = good[:16] + side.to_bytes(4, "big") * 2 + good[24:]
    return {
        "text": (f"data:image/png;base64,{b64(b'not an image')}", "is not an image dflash reads"),
        "truncated": (f"data:image/png;base64,{b64(good[: len(good) // 2])}", "could not be decoded as an image"),
        "huge": (f"data:image/png;base64,{b64(huge)}", f"is {side}x{side} pixels"),
        "base64": ("data:image/png;base64,@@@", "not valid base64"),
        "remote": ("https://example.com/cat.png", "Image URLs are refused"),
    }


def test_bad_images_are_a_400_in_each_api_and_the_server_goes_on(urls):
    """Each bad image is a 400 naming the fault, in OpenAI's and Anthropic's error shapes; the server then answers."""
    url = urls["plain"]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
    claude = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0, timeout=120)
    for name, (data_url, words) in bad_images().items():
        part = {"type": "image_url", "image_url": {"url": data_url}}
        with pytest.raises(openai.BadRequestError, match=words):
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": [part]}], max_tokens=2)
        if data_url.startswith("data:"):
            source = {"type": "base64", "media_type": "image/png", "data": data_url.partition(",")[2]}
        else:
            source = {"type": "url", "url": data_url}
        block = {"type": "image", "source": source}
        with pytest.raises(anthropic.BadRequestError, match=words) as caught:
            claude.messages.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": [block]}])
        assert caught.value.body["type"] == "error", name
    assert openai_chat(url, png(0))[0]


def test_an_image_to_a_model_without_a_projector_is_a_400(model, urls):
    """An engine with no --mmproj refuses an image with one sentence (Ollama's error shape here)."""
    engine = engine_of(model, None)
    engine.projector = None
    with serving(engine) as url:
        client = ollama.Client(host=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
        with pytest.raises(ollama.ResponseError, match="--mmproj") as caught:
            client.chat("tiny", messages=[{"role": "user", "content": "hi", "images": [png(0)]}])
        assert caught.value.status_code == 400
        assert client.chat("tiny", messages=[{"role": "user", "content": "hi"}], options={"num_predict": 2})


def test_an_image_at_the_prompts_end_is_served(model):
    """A template that renders only the content: the prompt ends a few ids after the image's rows, which the reply
    reader's look at the prompt's last ids must skip (an image row is no token: llama.cpp aborts on it)."""
    engine = engine_of(model, None)
    bare = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
    config = engine.models.tokenizer.config
    engine.models.tokenizer.config = use_template(config, bare, model / "model.gguf")
    with serving(engine) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
        part = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64(png(0))}"}}
        answer = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": [part]}], temperature=0, max_tokens=4
        )
        assert answer.usage.prompt_tokens < ROWS + 8 + 8
