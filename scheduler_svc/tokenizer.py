"""The scheduler's tokenizer: text and chat messages to token ids and back, from a local Hugging Face
folder or a GGUF file. Must not import torch, cupy, grpc or generated protobuf code.
"""

import os
from typing import Any

import transformers
from jinja2 import TemplateError
from packaging.version import Version
from transformers import PreTrainedTokenizerFast

from pagedserve_common.gguf_metadata import read_gguf_metadata


def warm_imports() -> None:
    """Imports what loading a GGUF tokenizer needs (transformers' model registry, the slow part
    of the load), so the scheduler can do it while it waits for its first executor rather than
    after the executor answered."""
    _gguf_tokenizer_api()


def _gguf_tokenizer_api():
    """transformers' GGUF tokenizer mapping and converter: `integrations/gguf/` from 5.18; in 5.17,
    `integrations/ggml`, whose converters are keyed by model type, not by `general.architecture`.
    Chosen by version, not by trying: 5.17's `integrations/gguf/__init__` imports torch."""
    if Version(transformers.__version__) >= Version("5.18"):
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer)
        return GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer
    from transformers.integrations.ggml import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer

    def convert_by_model_type(architecture: str, tokenizer_dict: dict):
        return convert_gguf_tokenizer(_GGML_MODEL_TYPES.get(architecture, architecture), tokenizer_dict)

    return GGUF_TOKENIZER_MAPPING, convert_by_model_type


# `general.architecture` -> model type, where 5.17's `load_gguf_checkpoint` renames it
_GGML_MODEL_TYPES = {
    "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "qwen35": "qwen3_5_text", "gemma3": "gemma3_text",
    "gemma4": "gemma4_text", "minimax-m2": "minimax_m2",
}


# `tokenizer.ggml.pre` values llama.cpp splits as another it knows (GLM-4's is Llama 3's regex,
# llama.cpp's CHATGLM4), which transformers would leave to GPT-2's split
_GGUF_PRE_ALIASES = {"glm4": "llama3", "chatglm-bpe": "llama3"}


# special token name -> the GGUF key (under `tokenizer.ggml.`) holding its id; as in transformers
_GGUF_SPECIAL_TOKEN_KEYS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}


# How much of a chat template's own error message a refusal quotes.
_MAX_TEMPLATE_ERROR_CHARS = 256


class ChatTemplateError(ValueError):
    """The model's chat template refused the messages (its raise_exception, e.g. a role it does
    not take) or failed to render them."""


class Tokenizer:
    """A thin wrapper over a transformers fast tokenizer: plain lists of ints in and out."""

    def __init__(self, hf_tokenizer: PreTrainedTokenizerFast):
        self.hf_tokenizer = hf_tokenizer
        self.eos_token_id: int | None = hf_tokenizer.eos_token_id
        # the full vocabulary, added tokens included: every id the model can be given or sample
        self.vocab_size: int = len(hf_tokenizer)
        self.all_special_ids: frozenset[int] = frozenset(hf_tokenizer.all_special_ids)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` as `tokenizer(text).input_ids` gives them (HF `generate` users' way)."""
        return list(self.hf_tokenizer(text).input_ids)

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None
                            ) -> list[int]:
        """Token ids of `messages` rendered with the model's chat template, generation prompt added
        and `tools` (OpenAI's function definitions) given to it (transformers' own rendering);
        ChatTemplateError if the template refuses them."""
        try:
            encoding = self.hf_tokenizer.apply_chat_template(messages, tools=tools,
                                                             add_generation_prompt=True,
                                                             tokenize=True)
        except TemplateError as err:
            raise ChatTemplateError(str(err)[:_MAX_TEMPLATE_ERROR_CHARS]) from None
        # transformers 5 returns a BatchEncoding here, 4.x a plain list
        ids = encoding["input_ids"] if hasattr(encoding, "keys") else encoding
        return list(ids)

    @property
    def has_chat_template(self) -> bool:
        return bool(self.hf_tokenizer.chat_template)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf_tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)


def load_tokenizer(source: str) -> Tokenizer | None:
    """The tokenizer in `source`: a local HF folder, a `.gguf` file, or "" for none (token-id prompts only).
    Folders load through `PreTrainedTokenizerFast` (their `tokenizer.json`), not `AutoTokenizer`,
    whose import chain (`configuration_utils` -> `modeling_rope_utils`) imports torch."""
    if not source:
        return None
    if os.path.isdir(source):
        if not os.path.isfile(os.path.join(source, "tokenizer.json")):
            raise FileNotFoundError(f"{source!r} has no tokenizer.json")
        return Tokenizer(PreTrainedTokenizerFast.from_pretrained(source, local_files_only=True))
    if source.endswith(".gguf") and os.path.isfile(source):
        return Tokenizer(_load_gguf_tokenizer(source))
    raise FileNotFoundError(f"no tokenizer at {source!r}: expected a local folder or a .gguf file")


def _load_gguf_tokenizer(path: str) -> PreTrainedTokenizerFast:
    """Not `from_pretrained(..., gguf_file=...)`: in transformers 5.x that path imports
    `integrations/gguf/reader.py`, which imports torch. We read the GGUF header ourselves
    (`read_gguf_metadata`), arrange it as `get_gguf_tokenizer` does and hand it to the torch-free
    `convert_gguf_tokenizer`, which builds the same `tokenizers.Tokenizer`; tests hold the result
    to transformers' own GGUF path and to the lowest transformers the pin admits (5.17)."""
    metadata = read_gguf_metadata(path, prefixes=("general.architecture", "tokenizer."))
    architecture, tokenizer_dict, tokenizer_config = _gguf_tokenizer_fields(metadata)
    _, convert_gguf_tokenizer = _gguf_tokenizer_api()
    # The converter's extra kwargs are dropped: from 5.18 there are none. 5.17's name unk/bos/eos
    # (passing them too raised "multiple values for keyword argument 'unk_token'"), and wrongly:
    # bos and eos both from `bos_token_id`; `tokenizer_config` has them from the file's own ids.
    # The rest are llama-3 flags a fast tokenizer ignores (`clean_up_tokenization_spaces=True`,
    # which 5.17 skips with a warning for BPE; `legacy`; `add_prefix_space=None`).
    backend, _extra_kwargs = convert_gguf_tokenizer(architecture, tokenizer_dict)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **tokenizer_config)


def _gguf_tokenizer_fields(metadata: dict[str, Any]) -> tuple[str, dict, dict]:
    """`(architecture, tokenizer_dict, tokenizer_config)` exactly as transformers' `get_gguf_tokenizer`."""
    mapping, _ = _gguf_tokenizer_api()
    grouped = {
        group: {name: metadata[f"tokenizer.{key}"] for key, name in renames.items() if f"tokenizer.{key}" in metadata}
        for group, renames in mapping.items()
    }
    tokenizer_dict, tokenizer_config = grouped["tokenizer"], grouped["tokenizer_config"]
    pre = tokenizer_dict.get("pre_tokenizer_type")
    if pre in _GGUF_PRE_ALIASES:
        tokenizer_dict["pre_tokenizer_type"] = _GGUF_PRE_ALIASES[pre]
    tokenizer_type = tokenizer_dict.get("tokenizer_type")
    if tokenizer_type == "llama":
        # llama.cpp adds BOS to a sentencepiece vocabulary whose file does not say otherwise
        tokenizer_config.setdefault("add_bos_token", True)
    elif tokenizer_type == "gemma4":
        # its chat template writes `<bos>` itself
        tokenizer_config["add_bos_token"] = False
    for name, key in _GGUF_SPECIAL_TOKEN_KEYS.items():
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        tokenizer_config[name] = tokenizer_dict["tokens"][token_id] if token_id is not None else None
    return metadata["general.architecture"], tokenizer_dict, tokenizer_config
