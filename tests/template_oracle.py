"""Chat templates rendered by transformers' apply_chat_template, run by .venv-oracle's python (never imported by
the tests). Reads a JSON list of cases on stdin ({template, messages, tools, kwargs}), writes a JSON list of the
rendered texts (or {"error": ...} where transformers refuses) on stdout."""

from __future__ import annotations

import json
import sys

from transformers import AutoTokenizer


def main() -> None:
    tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
    rendered = []
    for case in json.load(sys.stdin):
        try:
            text = tokenizer.apply_chat_template(
                case["messages"],
                tools=case["tools"],
                chat_template=case["template"],
                tokenize=False,
                add_generation_prompt=True,
                **case["kwargs"],
            )
            rendered.append(text)
        except Exception as exc:  # the template's own refusal: compared with dflash's, not a crash of this script
            rendered.append({"error": f"{type(exc).__name__}: {exc}"})
    json.dump(rendered, sys.stdout)


if __name__ == "__main__":
    main()
