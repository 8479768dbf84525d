"""Chat templates of each served family's shape, rendered through both APIs' paths (gRPC chat
messages, OpenAI messages) into the same token ids as transformers' apply_chat_template with
add_generation_prompt on the same folder. The templates are written here in the style of each
family (Qwen2.5/Qwen3 with tools and enable_thinking, GLM-4, Gemma, Phi-3, Llama 3); they are not
the official files. The tokenizer is a small byte-level BPE trained in the test."""
import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from protos import generate_pb2
from scheduler_svc.errors import InvalidArgument
from scheduler_svc.openai_protocol import ChatCompletionRequest, chat_specs
from scheduler_svc.request import ModelLimits, RequestLimits, prepare
from scheduler_svc.tokenizer import load_tokenizer
from scheduler_svc.wire import spec_from_proto

QWEN = """{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\\n</tools><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' %}
{%- set content = message.content.split('</think>')[-1].lstrip('\\n') %}
{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}
{%- elif not (message.role == 'system' and loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}
{{- '<think>\\n\\n</think>\\n\\n' }}
{%- endif %}
{%- endif %}"""

GLM4 = """[gMASK]<sop>
{%- for message in messages %}<|{{ message.role }}|>
{{ message.content }}
{%- endfor %}
{%- if add_generation_prompt %}<|assistant|>
{% endif %}"""

GEMMA = """{{ bos_token }}
{%- if messages[0].role == 'system' %}
{%- set first_user_prefix = messages[0].content + '\\n\\n' %}
{%- set loop_messages = messages[1:] %}
{%- else %}
{%- set first_user_prefix = '' %}
{%- set loop_messages = messages %}
{%- endif %}
{%- for message in loop_messages %}
{%- if (message.role == 'user') != (loop.index0 % 2 == 0) %}
{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
{%- endif %}
{%- set role = 'model' if message.role == 'assistant' else message.role %}
{{- '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}
{{- message.content | trim }}<end_of_turn>
{% endfor %}
{%- if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"""

PHI3 = """{% for message in messages %}
{%- if message['role'] in ('system', 'user', 'assistant') %}
{{- '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}"""

LLAMA3 = """{{- bos_token }}
{%- if not date_string is defined %}{%- set date_string = '26 Jul 2024' %}{%- endif %}
{%- if messages[0].role == 'system' %}
{%- set system_message = messages[0].content | trim %}
{%- set messages = messages[1:] %}
{%- else %}
{%- set system_message = '' %}
{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}
{{- 'Cutting Knowledge Date: December 2023\\nToday Date: ' + date_string + '\\n\\n' }}
{{- system_message + '<|eot_id|>' }}
{%- for message in messages %}
{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' }}
{{- message.content | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}"""

# family -> (template, its special tokens, bos, eos, the end of the generation prompt)
FAMILIES = {
    "qwen3": (QWEN, ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>"],
              None, "<|im_end|>", "<|im_start|>assistant\n"),
    "glm4": (GLM4, ["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>",
                    "<|observation|>", "<|endoftext|>"], None, "<|endoftext|>", "<|assistant|>\n"),
    "gemma": (GEMMA, ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"], "<bos>",
              "<end_of_turn>", "<start_of_turn>model\n"),
    "phi3": (PHI3, ["<s>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>",
                    "<|end|>"], "<s>", "<|end|>", "<|assistant|>\n"),
    "llama3": (LLAMA3, ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                        "<|end_header_id|>", "<|eot_id|>"], "<|begin_of_text|>", "<|eot_id|>",
               "<|start_header_id|>assistant<|end_header_id|>\n\n"),
}
CORPUS = ["You are a helpful assistant.", "What is the capital of France? Paris.",
          "Cutting Knowledge Date: December 2023", "Tell me a joke about GPUs, please!",
          "日本語のテキスト and émigré café", "def f(x):\n    return x ** 2"] * 4
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Answer in one word."},
     {"role": "user", "content": "Capital of France?"},
     {"role": "assistant", "content": "<think>\nEasy.\n</think>\n\nParis."},
     {"role": "user", "content": "  And of Japan? 日本 "}],
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """family -> a tokenizer folder saved by transformers: a byte-level BPE, the family's special
    tokens, its chat template."""
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    out = {}
    for family, (template, specials, bos, eos, _) in FAMILIES.items():
        hf = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token=bos, eos_token=eos)
        hf.add_special_tokens({"additional_special_tokens": specials})
        hf.chat_template = template
        path = tmp_path_factory.mktemp(family)
        hf.save_pretrained(path)
        out[family] = str(path)
    return out


def _reference(folder, messages) -> list[int]:
    ids = AutoTokenizer.from_pretrained(folder).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _grpc_ids(tokenizer, messages) -> list[int]:
    req = generate_pb2.GenerateRequest(chat=generate_pb2.ChatMessages(
        messages=[generate_pb2.ChatMessage(**m) for m in messages]))
    spec = spec_from_proto(req, "r", RequestLimits())
    return prepare(spec, tokenizer, ModelLimits(tokenizer.vocab_size, 4096, None)).prompt_token_ids


def _openai_ids(tokenizer, messages, parts: bool = False) -> list[int]:
    if parts:  # content as text parts, one per line: vLLM joins them with newlines
        messages = [{**m, "content": [{"type": "text", "text": line}
                                      for line in m["content"].split("\n")]} for m in messages]
    (spec,) = chat_specs(ChatCompletionRequest(messages=messages), "r")
    return prepare(spec, tokenizer, ModelLimits(tokenizer.vocab_size, 4096, None)).prompt_token_ids


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_both_apis_render_as_transformers(folders, family, conversation):
    messages = CONVERSATIONS[conversation]
    tokenizer = load_tokenizer(folders[family])
    expected = _reference(folders[family], messages)
    assert _grpc_ids(tokenizer, messages) == expected
    assert _openai_ids(tokenizer, messages) == expected
    assert _openai_ids(tokenizer, messages, parts=True) == expected
    text = tokenizer.decode(expected, skip_special_tokens=False)
    assert text.endswith(FAMILIES[family][4])  # the generation prompt is there
    assert "Easy." not in text or family != "qwen3"  # Qwen3 drops past thinking


def test_a_templates_refusal_is_a_bad_request_on_both_apis(folders):
    """Gemma's template raises for roles that do not alternate: the request fails naming the
    prompt and quoting the template, and nothing else."""
    tokenizer = load_tokenizer(folders["gemma"])
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    for path in (_grpc_ids, _openai_ids):
        with pytest.raises(InvalidArgument, match="prompt.chat: the model's chat template "
                                                  "refused the messages: Conversation roles must "
                                                  "alternate"):
            path(tokenizer, messages)
    assert _grpc_ids(tokenizer, messages[:1]) == _reference(folders["gemma"], messages[:1])
