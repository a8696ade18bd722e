"""A catalog model assembled by an installed package (catalog.package_file): written once into the session's Hugging
Face cache, reused only while its sha256 is the package's, assembled again when the file was corrupted."""

from __future__ import annotations

import hashlib
import sys
import types
from pathlib import Path

import pytest

from dflash_local import catalog
from dflash_local.errors import DFlashError

CONTENT = bytes(range(256)) * 64


@pytest.fixture()
def package(monkeypatch, tmp_path) -> types.ModuleType:
    """A package `fake_model_pkg` whose assemble() writes CONTENT (checking its sha256, as the registry's do) and
    counts its calls; the test's own Hugging Face cache."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    module = types.ModuleType("fake_model_pkg")
    module.MODEL_NAME = "fake.gguf"
    module.EXPECTED_SHA256 = hashlib.sha256(CONTENT).hexdigest()
    module.calls = 0
    module.content = CONTENT

    def assemble(path: Path) -> Path:
        module.calls += 1
        Path(path).write_bytes(module.content)
        if hashlib.sha256(Path(path).read_bytes()).hexdigest() != module.EXPECTED_SHA256:
            raise ValueError("Assembled file sha256 did not match expected value")
        return Path(path)

    module.assemble = assemble
    monkeypatch.setitem(sys.modules, "fake_model_pkg", module)
    return module


def test_a_stamped_file_is_reused_without_hashing_and_a_corrupted_one_is_assembled_again(package, monkeypatch):
    path = catalog.package_file("fake_model_pkg")
    assert path.read_bytes() == CONTENT and package.calls == 1
    assert sorted(p.name for p in path.parent.iterdir()) == ["fake.gguf", "fake.gguf.sha256.json"]

    hashed = []
    digest = catalog.file_digest
    monkeypatch.setattr(catalog, "file_digest", lambda *args: hashed.append(args[0]) or digest(*args))
    assert catalog.package_file("fake_model_pkg") == path and package.calls == 1 and hashed == []  # the stamp holds

    data = bytearray(CONTENT)
    data[len(data) // 2] ^= 0xFF  # same size, one byte changed (and a new mtime)
    path.write_bytes(bytes(data))
    assert catalog.package_file("fake_model_pkg") == path
    assert hashed == [path] and package.calls == 2 and path.read_bytes() == CONTENT  # hashed, found bad, rebuilt

    hashed.clear()
    catalog._stamp_path(path).unlink()  # no stamp (a file from before stamps): hashed once, then stamped
    assert catalog.package_file("fake_model_pkg") == path and hashed == [path] and package.calls == 2
    assert catalog.package_file("fake_model_pkg") == path and hashed == [path] and package.calls == 2


def test_a_package_that_cannot_assemble_its_file_is_one_sentence_and_leaves_nothing(package):
    package.content = b"not the model"
    with pytest.raises(DFlashError, match=r"^The package fake_model_pkg could not assemble its model file \("):
        catalog.package_file("fake_model_pkg")
    folder = catalog.cache_dir() / "packages" / "fake_model_pkg"
    assert list(folder.iterdir()) == []
