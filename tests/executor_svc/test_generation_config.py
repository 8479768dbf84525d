"""The model folder's generation config as the executor reads it (what vLLM takes from it) and
as Describe carries it to the scheduler; a value no request could have fails the load by name."""
import json

import pytest
from transformers import GenerationConfig

from executor_svc.generation_config import read_generation_config
from executor_svc.step import ExecutorInfo, ModelGenerationConfig
from executor_svc.wire import info_to_proto
from scheduler_svc.sampling_params import GenerationDefaults
from scheduler_svc.wire import description_from_proto

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")


def _folder(tmp_path, generation_config: dict | None):
    (tmp_path / "config.json").write_text("{}")
    if generation_config is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation_config))
    return str(tmp_path)


def test_the_values_vllm_takes_from_a_file_transformers_wrote(tmp_path):
    """GLM-4's three EOS ids and Qwen3's sampling defaults, saved by transformers: what
    GenerationConfig.to_diff_dict keeps of them (vLLM's reading) is what Describe carries."""
    GenerationConfig(eos_token_id=[151329, 151336, 151338], temperature=0.6, top_p=0.95,
                     top_k=20, do_sample=True, pad_token_id=0).save_pretrained(tmp_path)
    got = read_generation_config(str(tmp_path), (1,))
    diff = GenerationConfig.from_pretrained(tmp_path).to_diff_dict()
    assert got == ModelGenerationConfig(
        eos_token_ids=tuple(diff["eos_token_id"]),
        **{key: diff[key] for key in SAMPLING_KEYS if diff.get(key) is not None})
    assert got.eos_token_ids == (151329, 151336, 151338) and got.min_p is None


def test_without_the_file_config_jsons_eos_ids_and_no_defaults(tmp_path):
    assert read_generation_config(_folder(tmp_path, None), (2, 5)) == \
        ModelGenerationConfig(eos_token_ids=(2, 5))


def test_gguf_files_and_presets_have_none(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert read_generation_config(str(gguf), (2,)) == ModelGenerationConfig()
    assert read_generation_config("preset:tiny", (2,)) == ModelGenerationConfig()


def test_null_and_absent_values_are_unset_and_one_eos_id_is_a_list(tmp_path):
    got = read_generation_config(
        _folder(tmp_path, {"eos_token_id": 7, "temperature": None, "max_new_tokens": 512,
                           "top_k": 0, "do_sample": False}), ())
    assert got == ModelGenerationConfig(eos_token_ids=(7,), max_new_tokens=512, top_k=0)


@pytest.mark.parametrize("key, value", [
    ("temperature", -0.5), ("temperature", "0.7"), ("top_p", 0), ("top_p", 1.5),
    ("top_k", 2.5), ("top_k", -3), ("min_p", 2), ("repetition_penalty", 0),
    ("max_new_tokens", 0), ("max_new_tokens", True), ("eos_token_id", [1, -2]),
    ("eos_token_id", 2**32), ("eos_token_id", "</s>"),
])
def test_a_value_no_request_could_have_fails_naming_file_and_key(tmp_path, key, value):
    folder = _folder(tmp_path, {key: value})
    with pytest.raises(ValueError, match=f"generation_config.json: {key} must be"):
        read_generation_config(folder, ())


def test_a_malformed_file_fails_naming_it(tmp_path):
    (tmp_path / "generation_config.json").write_text("{\"temperature\": 0.6,")
    with pytest.raises(ValueError, match="generation_config.json: not a readable JSON file"):
        read_generation_config(str(tmp_path), ())
    (tmp_path / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="must hold a JSON object, got list"):
        read_generation_config(str(tmp_path), ())


def _info(generation_config: ModelGenerationConfig) -> ExecutorInfo:
    return ExecutorInfo("m", "fp", "float32", 16, 8, 0, 64, 100, "", "cpu", generation_config)


def test_describe_carries_it_to_the_scheduler():
    g = ModelGenerationConfig(eos_token_ids=(2, 7), temperature=0.6, top_k=20,
                              repetition_penalty=1.05, max_new_tokens=300)
    d = description_from_proto(info_to_proto(_info(g), 1))
    assert d.eos_token_ids == (2, 7)
    assert d.generation_defaults == GenerationDefaults(temperature=0.6, top_k=20,
                                                       repetition_penalty=1.05, max_tokens=300)


def test_a_model_without_one_sends_no_message_and_an_old_peer_reads_it_as_none():
    msg = info_to_proto(_info(ModelGenerationConfig()), 1)
    assert not msg.HasField("generation_config")
    d = description_from_proto(msg)
    assert d.eos_token_ids == () and d.generation_defaults == GenerationDefaults()
