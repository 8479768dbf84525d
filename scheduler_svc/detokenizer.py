"""Incremental detokenization of one sequence's output: a text delta per sampled token, never a
broken UTF-8 sequence. Must not import torch, cupy, grpc or generated protobuf code.
"""

from scheduler_svc.tokenizer import Tokenizer

# prompt tokens decoded in front of the output as context (vLLM's choice: 5 before the read offset)
INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """vLLM's prefix_offset/read_offset algorithm, on token ids.

    `token_ids` holds the last few prompt ids, then every output id. Text up to `read_offset` has
    been emitted; `token_ids[prefix_offset:read_offset]` is decoded again as context for the next
    token, so that tokens which only make sense together (a UTF-8 character split over byte tokens,
    a leading-space marker) decode as they would in one piece. A step whose text ends in U+FFFD is
    held back: the character is not complete yet.

    Windows are decoded with `Tokenizer.decode` on ids (not `convert_tokens_to_string` on token
    strings) so added and special tokens are handled exactly as in a full decode. For byte-level
    BPE tokenizers (SmolLM2, Llama 3, Qwen2) the deltas then concatenate to
    `decode(output_ids, skip_special_tokens)` whenever the prompt ends on a character boundary.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = list(prompt_token_ids[-INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET - 2 :])
        self.read_offset = len(self.token_ids)
        self.prefix_offset = max(self.read_offset - INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET, 0)

    def step(self, token_id: int) -> str:
        """The new text that `token_id` completes; "" while a character is still incomplete."""
        self.token_ids.append(token_id)
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        new_text = self._decode(self.prefix_offset, len(self.token_ids))
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return new_text[len(prefix_text) :]

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character decodes to U+FFFD, as in a full decode)."""
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        new_text = self._decode(self.prefix_offset, len(self.token_ids))
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return new_text[len(prefix_text) :]

    def _decode(self, start: int, end: int) -> str:
        return self.tokenizer.decode(self.token_ids[start:end], skip_special_tokens=self.skip_special_tokens)
