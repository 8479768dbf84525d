"""The model fingerprint covers the weight bytes (issue 9, item 11); the digest cache is keyed by
stat, written atomically, and never fatal."""
import json
import logging
import os
import shutil

import pytest

from executor_svc import fingerprint
from executor_svc.fingerprint import CACHE_FILE, DigestCache, model_fingerprint, source_identity
from executor_svc.model_config import ModelConfig, preset_hf_config
from executor_svc.model_loader import build_hf_model
from tests.executor_svc.helpers import hf_model

CONFIG = ModelConfig.from_hf_config(preset_hf_config("tiny"))


def fp(source, cache_dir=None) -> str:
    return model_fingerprint(CONFIG, source_identity(str(source), cache_dir))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Two HF folders of the tiny preset: same config, weights drawn under seeds 0 and 1."""
    root = tmp_path_factory.mktemp("models")
    hf_model("tiny").save_pretrained(root / "a")
    build_hf_model("tiny", seed=1).save_pretrained(root / "b")
    for folder in ("a", "b"):  # a tokenizer file, so that tokenizer identity is covered too
        (root / folder / "tokenizer.json").write_text('{"version": "1.0"}')
    return root / "a", root / "b"


@pytest.fixture()
def hash_calls(monkeypatch):
    """Records every file hashed (the real hash still runs)."""
    calls, real = [], fingerprint.file_sha256
    monkeypatch.setattr(fingerprint, "file_sha256", lambda path: calls.append(path) or real(path))
    return calls


def test_same_config_different_weights_differ(folders):
    a, b = folders
    assert (a / "config.json").read_text() == (b / "config.json").read_text()
    assert fp(a) != fp(b)


def test_identical_copy_in_another_directory_matches(folders, tmp_path):
    a, _ = folders
    copy = tmp_path / "elsewhere" / "renamed"
    shutil.copytree(a, copy)
    assert fp(copy, tmp_path / "cache") == fp(a, tmp_path / "cache") == fp(a)


def test_tokenizer_files_are_covered(folders, tmp_path):
    a, _ = folders
    copy = tmp_path / "copy"
    shutil.copytree(a, copy)
    (copy / "tokenizer.json").write_text('{"version": "2.0"}')
    assert fp(copy) != fp(a)


def test_cache_hit_reads_no_file(folders, tmp_path, monkeypatch):
    a, _ = folders
    first = fp(a, tmp_path)

    def must_not_hash(path):
        raise AssertionError(f"{path} hashed despite a cache hit")

    monkeypatch.setattr(fingerprint, "file_sha256", must_not_hash)
    assert fp(a, tmp_path) == first


def test_touched_identical_file_is_rehashed_to_the_same_digest(folders, tmp_path, hash_calls):
    copy = tmp_path / "copy"
    shutil.copytree(folders[0], copy)
    first = fp(copy, tmp_path / "cache")
    weights = copy / "model.safetensors"
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    hash_calls.clear()
    assert fp(copy, tmp_path / "cache") == first
    assert hash_calls == [weights.resolve()]


def test_changed_weights_are_rehashed(folders, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(folders[0], copy)
    first = fp(copy, tmp_path / "cache")
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # same size, one byte of a tensor differs
    weights.write_bytes(bytes(data))
    assert fp(copy, tmp_path / "cache") != first


def test_corrupt_cache_warns_and_hashes(folders, tmp_path, caplog):
    a, _ = folders
    (tmp_path / CACHE_FILE).write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="executor_svc.fingerprint"):
        assert fp(a, tmp_path) == fp(a)
    assert "unreadable" in caplog.text
    entries = json.loads((tmp_path / CACHE_FILE).read_text())  # rewritten whole
    assert str((a / "model.safetensors").resolve()) in entries


def test_unwritable_cache_warns_and_hashes(folders, tmp_path, caplog):
    a, _ = folders
    (tmp_path / "file").write_text("")
    with caplog.at_level(logging.WARNING, logger="executor_svc.fingerprint"):
        assert fp(a, tmp_path / "file" / "cache") == fp(a)  # a folder under a file: mkdir fails
    assert "not written" in caplog.text


def test_cache_writes_merge_and_leave_no_temp_files(tmp_path):
    one, two = tmp_path / "one.gguf", tmp_path / "two.gguf"
    one.write_bytes(b"1" * 1000)
    two.write_bytes(b"2" * 1000)
    first, second = DigestCache(str(tmp_path / "c")), DigestCache(str(tmp_path / "c"))
    first.put(one, one.stat(), "d1")
    second.put(two, two.stat(), "d2")
    first.save()
    second.save()  # read before `first` wrote: its save must keep `first`'s entry
    fresh = DigestCache(str(tmp_path / "c"))
    assert fresh.get(one, one.stat()) == "d1" and fresh.get(two, two.stat()) == "d2"
    assert os.listdir(tmp_path / "c") == [CACHE_FILE]


def test_gguf_file_is_identified_by_content_alone(tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(os.urandom(4096))
    renamed = tmp_path / "sub" / "other-name.gguf"
    renamed.parent.mkdir()
    shutil.copy(gguf, renamed)
    assert fp(renamed) == fp(gguf)
    renamed.write_bytes(os.urandom(4096))
    assert fp(renamed) != fp(gguf)


def test_presets_hash_no_file(tmp_path, monkeypatch):
    monkeypatch.setattr(fingerprint, "file_sha256", lambda path: pytest.fail("hashed a preset"))
    assert source_identity("preset:tiny", str(tmp_path))["source"] == "preset:tiny"
    assert not (tmp_path / CACHE_FILE).exists()
