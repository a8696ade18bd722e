"""Real text found offline on this machine, split into a training corpus and disjoint held-out prompts.

Code: the running Python's standard library (.py files, tests left out). Prose: section-1 man pages rendered as
plain text by `man`. Each file goes to the held-out side when a hash of its name says so (1 in 10), so no held-out
prompt comes from a file the drafter trained on.

    python models/gemma3-270m/recipe/corpus.py OUT [--man-pages 600] [--prompts 20]
writes OUT/train/ (the --corpus for `dflash train`) and OUT/heldout_prompts.jsonl (code and prose, alternating).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import subprocess
import sysconfig
from pathlib import Path


def held_out(name: str) -> bool:
    """Whether a file belongs to the held-out side (1 in 10, by a hash of its name)."""
    return hashlib.sha1(name.encode()).digest()[0] % 10 == 0


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idlelib", "lib2to3", "site-packages", "ensurepip", "turtledemo"}
    return [p for p in sorted(root.rglob("*.py")) if not skip & set(p.relative_to(root).parts)]


def man_pages(count: int) -> list[Path]:
    pages = sorted(Path("/usr/share/man/man1").glob("*.1*"))
    step = max(1, len(pages) // count) if count else 1
    return pages[::step][:count]


def render_man(page: Path) -> str:
    """A man page as plain text (no overstrikes), or '' when man cannot render it."""
    env = {**os.environ, "MANWIDTH": "80", "MAN_KEEP_FORMATTING": "0"}
    try:
        done = subprocess.run(
            ["man", "-l", "-P", "cat", str(page)], capture_output=True, text=True, env=env, timeout=20
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    text = done.stdout
    while "\b" in text:  # drop bold/underline overstrikes: "x\bx" -> "x"
        index = text.index("\b")
        text = text[: index - 1] + text[index + 1 :]
    return text if done.returncode == 0 else ""


def prompt_from(text: str, rng: random.Random, chars: int = 400) -> str | None:
    """A window of about `chars` characters starting at a line boundary, ending at a line end."""
    lines = text.splitlines(keepends=True)
    if sum(map(len, lines)) < 2 * chars:
        return None
    for _ in range(20):
        first = rng.randrange(len(lines))
        window = ""
        for line in lines[first:]:
            window += line
            if len(window) >= chars:
                break
        if len(window) >= chars // 2 and window.strip():
            return window.rstrip("\n")
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--man-pages", type=int, default=600)
    parser.add_argument("--prompts", type=int, default=20, help="held-out prompts of each kind")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    train = args.out / "train"
    (train / "code").mkdir(parents=True, exist_ok=True)
    (train / "man").mkdir(parents=True, exist_ok=True)
    held: dict[str, list[str]] = {"code": [], "prose": []}
    for path in stdlib_files():
        name = "_".join(path.parts[-2:])
        text = path.read_text(errors="replace")
        if held_out(name):
            held["code"].append(text)
        else:
            (train / "code" / name).write_text(text)
    for page in man_pages(args.man_pages):
        text = render_man(page)
        if not text:
            continue
        if held_out(page.name):
            held["prose"].append(text)
        else:
            (train / "man" / f"{page.name}.txt").write_text(text)
    rng = random.Random(args.seed)
    prompts: dict[str, list[str]] = {}
    for kind, texts in held.items():
        rng.shuffle(texts)
        found = [p for p in (prompt_from(t, rng) for t in texts) if p]
        prompts[kind] = found[: args.prompts]
    with open(args.out / "heldout_prompts.jsonl", "w") as out:
        for code, prose in zip(prompts["code"], prompts["prose"], strict=False):
            out.write(json.dumps({"prompt": code, "kind": "code"}) + "\n")
            out.write(json.dumps({"prompt": prose, "kind": "prose"}) + "\n")
    print(
        f"{args.out}: {sum(1 for _ in train.rglob('*') if _.is_file())} training files, "
        f"{min(map(len, prompts.values())) * 2} held-out prompts"
    )


if __name__ == "__main__":
    main()
