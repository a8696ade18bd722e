"""Structured output: a JSON schema's grammar holds every token; DFlash under it equals constrained plain decoding."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from scipy.stats import chisquare
from test_gguf_lossless import auto_policy

from dflash_local.decode import Settings, run
from dflash_local.drafters.torch_drafter import DFlashDrafter
from dflash_local.errors import DFlashError
from dflash_local.grammar import Grammar, compile_grammar, json_schema_grammar, load_schema
from dflash_local.runtime import LoadSpec, RuntimeConfig
from dflash_local.sampling import SamplingParams, mask_scores, probabilities
from dflash_local.targets.torch_llama import TorchLlamaTarget
from dflash_local.tokenizer import TextTokenizer, stop_token_ids

TINY = Path(__file__).resolve().parent.parent / "models" / "tiny"
RECORD = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "count": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "done": {"type": "boolean"},
    },
    "required": ["name", "count", "tags", "done"],
    "additionalProperties": False,
}
NEW_TOKENS = 96


def conforms(value, schema: dict) -> bool:
    """The value follows the schema (the keywords RECORD uses)."""
    if "enum" in schema:
        return value in schema["enum"]
    kind = schema["type"]
    if kind == "object":
        properties = schema["properties"]
        return (
            isinstance(value, dict)
            and set(schema["required"]) <= value.keys() <= properties.keys()
            and all(conforms(item, properties[key]) for key, item in value.items())
        )
    if kind == "array":
        return (
            isinstance(value, list)
            and len(value) <= schema["maxItems"]
            and all(conforms(item, schema["items"]) for item in value)
        )
    if kind == "string":
        return isinstance(value, str) and len(value) <= schema["maxLength"]
    if kind == "integer":
        return type(value) is int and schema["minimum"] <= value <= schema["maximum"]
    return kind == "boolean" and isinstance(value, bool)


@pytest.fixture(scope="module")
def tiny():
    target, drafter = (
        TorchLlamaTarget.load(TINY / "target", LoadSpec()),
        DFlashDrafter.load(TINY / "drafter", LoadSpec()),
    )
    tokenizer, stops = TextTokenizer.load(TINY / "target"), stop_token_ids(TINY / "target")
    grammar = compile_grammar(json_schema_grammar(RECORD), tokenizer, target.vocab_size, stops)
    return target, drafter, tokenizer, grammar


def _prompts(tokenizer, count: int) -> list[list[int]]:
    lines = (TINY / "heldout_prompts.jsonl").read_text().splitlines()[:count]
    return [tokenizer.encode(json.loads(line)["prompt"])[-64:] for line in lines]


def _equal_at_every_block(target, drafter, prompt: list[int], settings: Settings) -> tuple[list[int], bool]:
    """Constrained plain decoding's ids, checked equal to DFlash's at blocks 4, 16 and auto; and whether any DFlash
    step had a draft rejected (the matcher rolled back)."""
    expected, _ = run(target, None, prompt, replace(settings, draft=False))
    rejected = False
    for block, policy in ((4, None), (16, None), (None, auto_policy(drafter.block_size))):
        ids, stats = run(target, drafter, prompt, replace(settings, block_size=block), policy)
        assert ids == expected, block
        rejected |= any(a < k for a, k in zip(stats.acceptance_lengths, stats.block_sizes, strict=True))
    return expected, rejected


def test_schema_output_validates_and_equals_plain_decoding(tiny):
    """8 held-out prompts: the JSON parses, follows the schema, ends with the stop token, and DFlash gives the same
    ids as constrained plain decoding at blocks 4, 16 and auto, with drafts rejected along the way."""
    target, drafter, tokenizer, grammar = tiny
    rejected = []
    for prompt in _prompts(tokenizer, 8):
        settings = Settings(max_new_tokens=NEW_TOKENS, stop_ids=grammar.stop_ids, grammar=grammar)
        ids, any_rejected = _equal_at_every_block(target, drafter, prompt, settings)
        assert ids[-1] in grammar.stop_ids, tokenizer.decode(ids)
        assert conforms(json.loads(tokenizer.decode(ids[:-1])), RECORD), tokenizer.decode(ids)
        rejected.append(any_rejected)
    assert all(rejected)


def test_unconstrained_output_breaks_the_schema(tiny):
    """The same prompts without the grammar write Python, not JSON: the grammar is what makes the output valid."""
    target, _, tokenizer, grammar = tiny
    ids, _ = run(target, None, _prompts(tokenizer, 1)[0], Settings(24, draft=False, stop_ids=grammar.stop_ids))
    assert not tokenizer.decode(ids).startswith("{")


def test_any_json_object_equals_plain_decoding(tiny):
    """json_object (no schema): DFlash equals constrained plain decoding, and the text is a JSON object so far."""
    target, drafter, tokenizer, _ = tiny
    grammar = compile_grammar(json_schema_grammar(None), tokenizer, target.vocab_size, stop_token_ids(TINY / "target"))
    for prompt in _prompts(tokenizer, 2):
        ids, _ = _equal_at_every_block(target, drafter, prompt, Settings(max_new_tokens=48, grammar=grammar))
        assert tokenizer.decode(ids).startswith("{")


def test_tool_call_wrapping_holds_the_arguments(tiny):
    """A grammar with fixed text around the JSON (a tool call's wrapping): the output is that text around JSON that
    follows the parameters' schema."""
    target, drafter, tokenizer, _ = tiny
    prefix, suffix = '<tool_call>\n{"name": "record", "arguments": ', "}\n</tool_call>"
    text = json_schema_grammar(RECORD, prefix=prefix, suffix=suffix)
    grammar = compile_grammar(text, tokenizer, target.vocab_size, stop_token_ids(TINY / "target"))
    prompt = _prompts(tokenizer, 1)[0]
    ids, _ = _equal_at_every_block(target, drafter, prompt, Settings(max_new_tokens=NEW_TOKENS, grammar=grammar))
    out = tokenizer.decode(ids[:-1])
    assert out.startswith(prefix) and out.endswith(suffix), out
    assert conforms(json.loads(out[len(prefix) : -len(suffix)]), RECORD)


def _masked_pair_distribution(target, grammar: Grammar, prompt: list[int], params: SamplingParams) -> dict:
    """P(x1, x2 | prompt) under the grammar's masks, from the target's own conditionals."""
    matcher = grammar.matcher()
    target.trim(0)
    first = probabilities(
        mask_scores(target.forward(torch.tensor(prompt), features=False).logits[-1:], matcher.forbidden("cpu")), params
    )[0]
    table = {}
    for x1 in first.nonzero().flatten().tolist():
        matcher.consume(x1)
        target.trim(0)
        logits = target.forward(torch.tensor([*prompt, x1]), features=False).logits[-1:]
        second = probabilities(mask_scores(logits, matcher.forbidden("cpu")), params)[0]
        matcher.rollback(1)
        for x2 in second.nonzero().flatten().tolist():
            table[x1, x2] = float(first[x1] * second[x2])
    return table


def test_sampling_follows_the_masked_distribution(tiny):
    """T > 0 with a grammar: the first two tokens (the second drafted and rejection-sampled at block 4) follow the
    target's masked distribution (chi-square), and no masked-out pair ever appears."""
    target, drafter, tokenizer, _ = tiny
    schema = {"enum": ["red", "green", "blue", "yellow", "black", "white", "orange", "purple"]}  # 12 of 4096 pairs
    grammar = compile_grammar(
        json_schema_grammar(schema), tokenizer, target.vocab_size, stop_token_ids(TINY / "target")
    )
    prompt = tokenizer.encode("    return self._count + ")
    params, samples = SamplingParams(temperature=1.0), 400
    exact = _masked_pair_distribution(target, grammar, prompt, params)
    counts: dict[tuple[int, int], int] = {}
    settings = Settings(max_new_tokens=2, sampling=params, block_size=4, grammar=grammar)
    for seed in range(samples):
        ids, stats = run(target, drafter, prompt, replace(settings, seed=seed))
        assert stats.block_sizes == [2]
        counts[tuple(ids)] = counts.get(tuple(ids), 0) + 1
    assert set(counts) <= set(exact)
    observed, expected, pooled = [], [], [0, 0.0]
    for pair, probability in exact.items():
        if probability * samples < 5:
            pooled[0], pooled[1] = pooled[0] + counts.get(pair, 0), pooled[1] + probability * samples
        else:
            observed.append(counts.get(pair, 0))
            expected.append(probability * samples)
    observed.append(pooled[0])
    expected.append(pooled[1])
    assert len(observed) >= 6, "too few outcomes for a meaningful test"
    assert chisquare(observed, [e * samples / sum(expected) for e in expected]).pvalue > 1e-3


@pytest.mark.parametrize(
    "schema, problem",
    [
        ({"type": "objectx"}, "Invalid type: objectx"),
        ({"type": "object", "properties": 3}, "properties must be an object"),
        ({"type": "string", "pattern": "(["}, "unclosed character class"),
        ({"$ref": "#/defs/missing"}, "Pointer '/defs/missing' does not exist"),
        ([1, 2], "must be an object, not list"),
    ],
)
def test_a_malformed_schema_is_one_sentence(schema, problem):
    with pytest.raises(DFlashError) as error:
        json_schema_grammar(schema)
    message = str(error.value)
    assert problem in message and "\n" not in message and message.endswith("."), message


def test_a_schema_file_that_is_not_json_is_one_sentence(tmp_path):
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(DFlashError, match=r"^The JSON schema file .*bad\.json is not valid JSON \(.*\)\.$"):
        load_schema(tmp_path / "bad.json")
    with pytest.raises(DFlashError, match=r"cannot be read"):
        load_schema(tmp_path / "missing.json")


def test_gguf_target_equals_plain_decoding(tiny_gguf, heldout, drafter):
    """The bundled target in llama.cpp (F16), the grammar over llama.cpp's vocabulary: DFlash equals constrained
    plain decoding at blocks 4, 16 and auto, and the JSON follows the schema."""
    pytest.importorskip("llama_cpp")
    from dflash_local.gguf.tokenizer import GGUFTokenizer
    from dflash_local.targets.llamacpp import LlamaCppTarget

    target = LlamaCppTarget.load(tiny_gguf["f16"], LoadSpec(RuntimeConfig(threads=1), max_context=512))
    tokenizer = GGUFTokenizer.of_context(target.context)
    grammar = compile_grammar(json_schema_grammar(RECORD), tokenizer, target.vocab_size, target.stop_ids)
    for prompt in heldout[:3]:
        settings = Settings(max_new_tokens=NEW_TOKENS, stop_ids=grammar.stop_ids, grammar=grammar)
        ids, _ = _equal_at_every_block(target, drafter, prompt, settings)
        assert conforms(json.loads(tokenizer.decode(ids[:-1])), RECORD), tokenizer.decode(ids)


class NarrowDrafter:
    """The bundled drafter scoring only ids below `limit` (a draft vocabulary, as Gemma's drafter has)."""

    def __init__(self, inner: DFlashDrafter, limit: int) -> None:
        self.inner, self.limit = inner, limit

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def propose(self, *args, **kwargs) -> torch.Tensor:
        logits = self.inner.propose(*args, **kwargs).clone()
        logits[:, self.limit :] = float("-inf")
        return logits


def test_a_drafter_without_allowed_ids_ends_the_draft(tiny):
    """Where the drafter scores no id the grammar allows, the block ends there: still plain decoding's ids."""
    target, drafter, tokenizer, grammar = tiny
    narrow = NarrowDrafter(drafter, 96)  # bytes and a few merges: most of the schema's keys are out of its reach
    for prompt in _prompts(tokenizer, 2):
        settings = Settings(max_new_tokens=NEW_TOKENS, stop_ids=grammar.stop_ids, grammar=grammar)
        expected, _ = run(target, None, prompt, replace(settings, draft=False))
        ids, stats = run(target, narrow, prompt, replace(settings, block_size=16))
        assert ids == expected
        assert 1 in stats.block_sizes  # a step that verified no draft


def test_generate_json_schema_from_the_command_line(tmp_path):
    """`dflash generate --json-schema FILE`: the text is JSON following the schema; a malformed schema file is one
    `error:` sentence and exit 1, before any model loads."""
    from in_process import invoke

    (tmp_path / "record.json").write_text(json.dumps(RECORD))
    (tmp_path / "bad.json").write_text(json.dumps({"type": "object", "required": "name"}))
    common = ["generate", "--target", str(TINY / "target"), "--drafter", str(TINY / "drafter"), "--json"]
    common += ["--prompt", "def f(x):", "--max-new-tokens", str(NEW_TOKENS), "--block-size", "16"]
    result = invoke(*common, "--json-schema", str(tmp_path / "record.json"))
    assert result.exit_code == 0, result.stderr
    text = json.loads(result.stdout)["text"]
    assert conforms(json.loads(text), RECORD), text  # the whole text: no stop token's text after the JSON
    bad = invoke(*common, "--json-schema", str(tmp_path / "bad.json"))
    assert bad.exit_code == 1
    assert bad.stderr.strip() == "error: The JSON schema is not valid: Expected array for 'required', got \"name\"."


def test_a_gguf_vocabularys_token_bytes_are_read_without_deprecated_llama_cpp_calls(tiny_gguf):
    import warnings

    from dflash_local.gguf.tokenizer import GGUFTokenizer
    from dflash_local.grammar import _llama_token_bytes

    tokenizer = GGUFTokenizer.load(tiny_gguf["f16"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tokens = _llama_token_bytes(tokenizer.vocab)
    assert [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)] == []
    text = tokenizer.encode("def f(x):\n    return {'a': 1}", add_special_tokens=False)
    assert b"".join(tokens[i] for i in text) == tokenizer.decode(text).encode()
    eos = tokenizer.token_id(tokenizer.config["eos_token"])
    assert tokens[eos] == b"\xff" + tokenizer.config["eos_token"].encode()  # a control token: marked special
