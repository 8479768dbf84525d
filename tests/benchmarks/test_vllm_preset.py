"""vllm_preset: the config.json it gives vLLM for each preset, the offline_bench module it patches
(a stand-in here; the real one where ../shared is checked out beside the repository), and that
both sides then build the same requests."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import vllm_preset
from bench_serving import make_requests

SHARED_BENCH = Path(__file__).resolve().parents[3] / "shared" / "bench" / "vllm"

# What offline_bench's main() sees, written where the test can read it.
STAND_IN = '''
import json, sys
WORKLOADS = {"W1": (256, (64, 1024), (32, 512))}
CONFIG = {"model_type": "llama"}
VOCAB = 128256

def make_requests(workload):
    return VOCAB

def main():
    with open(sys.argv[sys.argv.index("--out") + 1], "w") as f:
        json.dump({"config": CONFIG, "vocab": VOCAB, "argv": sys.argv}, f)
'''


def test_qwen3_and_glm4_are_written_as_their_models_config_json():
    qwen3, glm4 = vllm_preset.hub_config("qwen3-8b"), vllm_preset.hub_config("glm4-9b")
    assert qwen3["architectures"] == ["Qwen3ForCausalLM"] and qwen3["model_type"] == "qwen3"
    assert (qwen3["vocab_size"], qwen3["num_hidden_layers"], qwen3["intermediate_size"],
            qwen3["num_key_value_heads"], qwen3["head_dim"]) == (151936, 36, 12288, 8, 128)
    assert (qwen3["rope_theta"], qwen3["max_position_embeddings"]) == (1e6, 40960)
    assert not qwen3["tie_word_embeddings"] and not qwen3["use_sliding_window"]
    assert glm4["architectures"] == ["Glm4ForCausalLM"] and glm4["model_type"] == "glm4"
    assert (glm4["vocab_size"], glm4["num_hidden_layers"], glm4["intermediate_size"],
            glm4["num_key_value_heads"], glm4["head_dim"]) == (151552, 40, 13696, 2, 128)
    assert glm4["partial_rotary_factor"] == 0.5 and glm4["attention_bias"]
    assert glm4["eos_token_id"] == [151329, 151336, 151338] and "bos_token_id" not in glm4
    assert (glm4["rope_theta"], glm4["max_position_embeddings"]) == (10000.0, 32768)


def test_the_driver_replaces_config_and_vocab_and_passes_every_other_flag(tmp_path,
                                                                          monkeypatch):
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # main() sets offline_bench's
    (tmp_path / "offline_bench.py").write_text(STAND_IN)
    out = tmp_path / "seen.json"
    vllm_preset.main(["--preset", "glm4-9b", "--vllm-dir", str(tmp_path), "--workloads", "W1",
                      "--out", str(out), "--max-num-seqs", "256"])
    seen = json.loads(out.read_text())
    assert seen["config"] == vllm_preset.hub_config("glm4-9b") and seen["vocab"] == 151552
    assert seen["argv"][1:] == ["--workloads", "W1", "--out", str(out), "--max-num-seqs", "256"]


@pytest.mark.parametrize("argv, message", [
    (["--preset", "tiny-llama3"], "only unscaled, unwindowed"),
    (["--preset", "nope"], "unknown preset 'nope'"),
    (["--preset", "qwen3-8b", "--vllm-dir", "/nonexistent"], "no offline_bench.py there"),
])
def test_what_it_cannot_run_is_one_usage_line(capsys, argv, message):
    with pytest.raises(SystemExit):
        vllm_preset.main(argv)
    assert message in capsys.readouterr().err


@pytest.mark.skipif(not (SHARED_BENCH / "offline_bench.py").is_file(),
                    reason="../shared/bench/vllm is not checked out beside the repository")
@pytest.mark.parametrize("preset", ["llama3-8b", "qwen3-8b"])
def test_the_real_offline_bench_then_builds_bench_servings_requests(preset):
    """llama3-8b's config is offline_bench's own CONFIG; after the patch its W1 requests are
    bench_serving's for the preset, ids and lengths."""
    bench = vllm_preset.load_offline_bench(SHARED_BENCH)
    if preset == "llama3-8b":
        assert vllm_preset.hub_config(preset) == bench.CONFIG
    config = vllm_preset.hub_config(preset)
    bench.CONFIG, bench.VOCAB = config, config["vocab_size"]
    assert bench.make_requests("W1") == make_requests("W1", config["vocab_size"])


# offline_bench's path to the engine, with its workload table: what the driver wraps and extends.
ENGINE_STAND_IN = '''
import json, sys
WORKLOADS = {"W1": (256, (64, 1024), (32, 512))}
CONFIG = {}
VOCAB = 128256

def use_vllm_site():
    pass

def main():
    use_vllm_site()
    from vllm import LLM
    engine = LLM(model="dummy", load_format="dummy")
    with open(sys.argv[sys.argv.index("--out") + 1], "w") as f:
        json.dump({"engine": engine, "workloads": sorted(WORKLOADS),
                   "quantization": CONFIG.get("quantization_config")}, f)
'''


def test_quantization_kv_cache_dtype_and_our_workloads_reach_offline_bench(tmp_path, monkeypatch):
    """--quantization writes quant_folder.py's quantization_config into the config, --kv-cache-dtype
    joins the engine's arguments, and workloads.py's workloads join offline_bench's table."""
    import types

    from benchmarks.quant_folder import quantization_config

    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=lambda **kw: kw))
    (tmp_path / "offline_bench.py").write_text(ENGINE_STAND_IN)
    out = tmp_path / "seen.json"
    vllm_preset.main(["--preset", "llama3-8b", "--vllm-dir", str(tmp_path), "--quantization",
                      "awq", "--kv-cache-dtype", "fp8", "--out", str(out)])
    seen = json.loads(out.read_text())
    assert seen["engine"] == {"model": "dummy", "load_format": "dummy", "kv_cache_dtype": "fp8"}
    assert seen["quantization"] == quantization_config("awq")
    assert {"W1", "W2", "W3", "decode-heavy"} <= set(seen["workloads"])
