"""The suite's own rules, as conftest enforces them on every test module at collection."""

from __future__ import annotations

from conftest import environ_captured_at_import


def test_a_module_that_copies_the_environment_at_import_is_caught():
    """ENVIRON_AT_IMPORT: a copy of os.environ in top-level code is reported with its line; reading one variable
    there, or the environment inside a function or a lambda, is not."""
    assert environ_captured_at_import('import os\n\nENV = {**os.environ, "A": "1"}\n') == 3
    assert environ_captured_at_import("import os\nENV = dict(os.environ)\n") == 2
    assert environ_captured_at_import("from os import environ\nENV = environ.copy()\n") == 2
    assert environ_captured_at_import("import os\nif True:\n    ENV = os.environ.copy()\n") == 3
    allowed = 'import os\nS = float(os.environ.get("S", "2"))\nF = lambda: {**os.environ}\n\n\ndef env():\n'
    assert environ_captured_at_import(allowed + "    return {**os.environ}\n") is None
