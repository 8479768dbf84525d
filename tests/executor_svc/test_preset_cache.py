"""A small preset's random weights kept in the cache folder: read back they are the draw's, bit for
bit, with its config, and the worker draws no more; another seed or dtype is drawn apart; an
entry that cannot be read is drawn again and rewritten; an unwritable folder costs a draw, never
a start."""
import pytest
import torch

from executor_svc import preset_cache
from executor_svc.model_config import ModelConfig
from executor_svc.model_loader import build_hf_model, hf_weights, load_model
from tests.executor_svc.test_model_families import FAMILIES


def _entries(cache):
    return sorted(p.name for p in (cache / "presets").glob("*.safetensors"))


def test_the_kept_draw_is_the_draw(tmp_path):
    drawn, config, *_ = load_model("preset:tiny", torch.float32, cache_dir=str(tmp_path))
    [entry] = _entries(tmp_path)
    assert entry.startswith("tiny-seed0-float32-cpu-")
    kept, kept_config, *_ = load_model("preset:tiny", torch.float32, cache_dir=str(tmp_path))
    assert kept_config == config
    reference = hf_weights(build_hf_model("tiny"))
    assert kept.embed_tokens.data_ptr() == kept.lm_head.data_ptr()  # tied again
    for name, tensor in preset_cache.load(str(tmp_path), "tiny", 0, torch.float32, "cpu")[1].items():
        assert torch.equal(tensor, reference[name]), name
    logits = [m.embed_tokens[:4] @ m.lm_head[:8].T for m in (drawn, kept)]
    assert torch.equal(*logits)


def test_another_seed_or_dtype_is_drawn_apart_and_other_code_replaces_its_entry(
        tmp_path, monkeypatch):
    load_model("preset:tiny", torch.float32, cache_dir=str(tmp_path))
    load_model("preset:tiny", torch.float32, seed=1, cache_dir=str(tmp_path))
    assert [name.split("-")[:3] for name in _entries(tmp_path)] == [
        ["tiny", "seed0", "float32"], ["tiny", "seed1", "float32"]]
    seed1 = preset_cache.load(str(tmp_path), "tiny", 1, torch.float32, "cpu")
    assert not torch.equal(seed1[1]["model.embed_tokens.weight"],
                           hf_weights(build_hf_model("tiny"))["model.embed_tokens.weight"])
    assert preset_cache.load(str(tmp_path), "tiny", 1, torch.bfloat16, "cpu") is None
    # another transformers draws anew and its entry takes the old one's place
    version = preset_cache.importlib.metadata.version
    monkeypatch.setattr(preset_cache.importlib.metadata, "version",
                        lambda name: "0.0" if name == "transformers" else version(name))
    assert preset_cache.load(str(tmp_path), "tiny", 1, torch.float32, "cpu") is None
    before = set(_entries(tmp_path))
    load_model("preset:tiny", torch.float32, seed=1, cache_dir=str(tmp_path))
    after = set(_entries(tmp_path))
    assert len(after) == 2 and len(after - before) == 1 and "seed1" in (after - before).pop()


def test_an_unreadable_entry_is_drawn_again_and_rewritten(tmp_path, caplog):
    load_model("preset:tiny", torch.float32, cache_dir=str(tmp_path))
    [entry] = (tmp_path / "presets").glob("*.safetensors")
    entry.write_bytes(entry.read_bytes()[:1000])
    _, config, *_ = load_model("preset:tiny", torch.float32, cache_dir=str(tmp_path))
    assert "not read" in caplog.text and config.architecture == "llama"
    assert preset_cache.load(str(tmp_path), "tiny", 0, torch.float32, "cpu") is not None


def test_an_unwritable_folder_and_a_large_preset_are_not_kept(tmp_path, monkeypatch, caplog):
    blocked = tmp_path / "file"
    blocked.write_text("a file where the folder would be")
    load_model("preset:tiny", torch.float32, cache_dir=str(blocked))
    assert "not written" in caplog.text
    monkeypatch.setattr(preset_cache, "MAX_BYTES", 1 << 20)
    load_model("preset:tiny", torch.float32, cache_dir=str(tmp_path / "cache"))
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_familys_config_survives_json(family):
    config = ModelConfig.from_hf_config(FAMILIES[family]())
    assert ModelConfig.from_json(config.to_json()) == config


def test_a_kept_preset_is_not_drawn_again(tmp_path, monkeypatch):
    """The worker's load, on a kept entry, builds no transformers model (whose import is the
    start's cost)."""
    from executor_svc import model_loader
    from executor_svc.config import ExecutorConfig
    from executor_svc.worker import Worker

    load_model("preset:tiny", torch.float32, cache_dir=str(tmp_path))

    def no_draw(*args, **kwargs):
        raise AssertionError("drawn again")
    monkeypatch.setattr(model_loader, "build_hf_model", no_draw)
    worker = Worker(ExecutorConfig(model="preset:tiny", fingerprint_cache_dir=str(tmp_path)))
    assert worker.runner.info.model_name == "preset:tiny"
    with pytest.raises(AssertionError, match="drawn again"):  # without the entry it would draw
        Worker(ExecutorConfig(model="preset:tiny", seed=3, fingerprint_cache_dir=str(tmp_path)))
