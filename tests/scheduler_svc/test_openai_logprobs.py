"""Logprobs in the OpenAI responses (issue 13): the chat and completions bodies built from engine
events, streamed and not, and the HTTP app over a real Engine whose fake executor returns
logprobs to the seqs that ask (n samples, a batch of prompts). Errors naming the parameter:
test_openai_protocol.py, test_openai_server.py. Real processes and the SDK:
tests/integration/test_openai_api.py."""
import json
import math
from dataclasses import replace

from scheduler_svc.openai_protocol import (ChatFormat, Choice, CompletionFormat, Reply,
                                           TokenTexts, apply)
from scheduler_svc.plan import StepResult
from scheduler_svc.request import FinishEvent, TokenEvent
from scheduler_svc.sampling_params import TokenLogprobs
from scheduler_svc.sequence import FinishReason
from test_engine import FakeClient
from test_openai_server import PROMPT, completion, run

TEXTS = {5: "He", 6: "Hi", 7: "\ufffd", 8: "\ufffd", 9: "é", 2: "<|im_end|>"}


class FakeTokenizer:
    def __init__(self) -> None:
        self.decoded: list[list[int]] = []

    def decode(self, ids, skip_special_tokens=True):
        assert skip_special_tokens is False  # an EOS shows as its own text, as vLLM's
        self.decoded.append(list(ids))
        return "".join(TEXTS[i] for i in ids)


# "He" (top-1), a piece of a character whose logprob is -inf and which is not among the top 2
# (two of which share a text), then "é" completing it, then the end
EVENTS = [TokenEvent(5, "He", 0, TokenLogprobs(-0.25, ((5, -0.25), (6, -2.5)))),
          TokenEvent(7, "", 1, TokenLogprobs(-math.inf, ((8, -0.5), (9, -0.75)))),
          TokenEvent(9, "é", 2, TokenLogprobs(-0.125, ((9, -0.125), (2, -3.0)))),
          FinishEvent(FinishReason.EOS, 4, 3, "")]


def replay(events=EVENTS) -> tuple[Choice, list]:
    choice = Choice()
    return choice, [apply(choice, event) for event in events]


def reply(tokenizer="fake") -> Reply:
    return Reply.new("x", "r", "m", TokenTexts(FakeTokenizer() if tokenizer else None))


def test_chat_logprobs_per_token_with_its_top_alternatives():
    choice, _ = replay()
    [body] = ChatFormat.response(reply(), [choice], 1)["choices"]
    assert body["message"]["content"] == "Heé"
    assert body["logprobs"] == {"content": [
        {"token": "He", "logprob": -0.25, "bytes": [72, 101], "top_logprobs": [
            {"token": "He", "logprob": -0.25, "bytes": [72, 101]},
            {"token": "Hi", "logprob": -2.5, "bytes": [72, 105]}]},
        {"token": "\ufffd", "logprob": -9999.0, "bytes": [239, 191, 189], "top_logprobs": [
            {"token": "\ufffd", "logprob": -0.5, "bytes": [239, 191, 189]},
            {"token": "é", "logprob": -0.75, "bytes": [195, 169]}]},
        {"token": "é", "logprob": -0.125, "bytes": [195, 169], "top_logprobs": [
            {"token": "é", "logprob": -0.125, "bytes": [195, 169]},
            {"token": "<|im_end|>", "logprob": -3.0, "bytes": list(b"<|im_end|>")}]}]}


def test_completion_logprobs_lists_sampled_token_first_then_the_top():
    choice, _ = replay()
    [body] = CompletionFormat.response(reply(), [choice], 1)["choices"]
    assert body["logprobs"] == {
        "tokens": ["He", "\ufffd", "é"],
        "token_logprobs": [-0.25, -9999.0, -0.125],
        # the sampled token's and the top k's: up to k + 1, a text already there kept once
        "top_logprobs": [{"He": -0.25, "Hi": -2.5}, {"\ufffd": -9999.0, "é": -0.75},
                         {"é": -0.125, "<|im_end|>": -3.0}],
        "text_offset": [0, 2, 2]}  # a token starts where the text released before it ends
    json.dumps(body, allow_nan=False)  # no -inf reaches JSON


def test_stream_chunks_carry_their_tokens_logprobs_and_add_up_to_the_response():
    for fmt, key in ((ChatFormat, "content"), (CompletionFormat, "tokens")):
        r = reply()
        choice, deltas = replay()
        chunks = [fmt.chunk(r, 0, d, None if i < 3 else "stop")["choices"][0]
                  for i, d in enumerate(deltas)]
        assert chunks[-1]["logprobs"] is None  # the finish chunk has no token
        whole = fmt.logprobs(r, choice.logprobs)
        for name in whole:
            assert [v for c in chunks[:-1] for v in c["logprobs"][name]] == whole[name]
        assert all(len(c["logprobs"][key]) == 1 for c in chunks[:-1])


def test_no_logprobs_unless_asked():
    choice, deltas = replay()
    plain = Reply.new("x", "r", "m")
    for fmt in (ChatFormat, CompletionFormat):
        assert fmt.response(plain, [choice], 1)["choices"][0]["logprobs"] is None
        assert fmt.chunk(plain, 0, deltas[0], None)["choices"][0]["logprobs"] is None


def test_token_texts_decode_each_id_once_or_name_it_without_a_tokenizer():
    tokenizer = FakeTokenizer()
    texts = TokenTexts(tokenizer)
    assert [texts(5), texts(2), texts(5)] == ["He", "<|im_end|>", "He"]
    assert tokenizer.decoded == [[5], [2]]
    assert TokenTexts(None)(42) == "token_id:42"


# --- the HTTP app over an Engine ------------------------------------------------------------

def fake_logprobs(seq_id: int, token_id: int, k: int) -> TokenLogprobs:
    """Logprobs that say which seq and token they belong to; the sampled token is the top-1."""
    top = tuple((token_id + i, -(seq_id + i) / 8) for i in range(k))
    return TokenLogprobs(-seq_id / 8, top)


class LogprobsClient(FakeClient):
    """The fake executor link, returning logprobs to the seqs that ask, as the executor does."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: dict[int, int] = {}

    async def send(self, plan) -> None:
        for s in plan.new_seqs:
            if s.sampling.logprobs is not None:
                self.asked[s.seq_id] = s.sampling.logprobs
        await super().send(plan)

    async def receive(self, plan) -> StepResult:
        result = await super().receive(plan)
        return replace(result, logprobs={
            seq_id: fake_logprobs(seq_id, token, self.asked[seq_id])
            for seq_id, token in result.sampled.items() if seq_id in self.asked})


def test_completions_of_n_samples_each_with_its_logprobs_streamed_or_not():
    def check(samples: list[dict]) -> None:
        for lp in samples:
            assert len(lp["tokens"]) == len(lp["token_logprobs"]) == 3  # every token usage counts
            assert all(t.startswith("token_id:") for t in lp["tokens"])  # no tokenizer
            assert [list(top) for top in lp["top_logprobs"]] == [
                [t, f"token_id:{int(t[9:]) + 1}"] for t in lp["tokens"]]  # sampled, then top 2
            assert len(set(lp["token_logprobs"])) == 1  # the fake's: one seq's
        # each sample its own: the fake's logprobs name the seq
        assert samples[0]["token_logprobs"] != samples[1]["token_logprobs"]

    async def test(client, engine, fake):
        await engine.wait_ready()
        body = completion(n=2, logprobs=2, max_tokens=3)
        status, raw = await client.request("POST", "/v1/completions", body)
        assert status == 200
        check([c["logprobs"] for c in json.loads(raw)["choices"]])
        status, raw = await client.request("POST", "/v1/completions", {**body, "stream": True})
        streamed = [{"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
                    for _ in range(2)]
        for event in raw.decode().split("\n\n")[:-2]:
            [c] = json.loads(event[6:])["choices"]
            for name, values in (c["logprobs"] or {}).items():
                streamed[c["index"]][name] += values
        check(streamed)
        plain = json.loads((await client.request("POST", "/v1/completions", completion()))[1])
        assert plain["choices"][0]["logprobs"] is None
    run(test, client=LogprobsClient())


def test_a_prompt_batch_keeps_each_choices_logprobs_apart():
    async def test(client, engine, fake):
        await engine.wait_ready()
        status, raw = await client.request("POST", "/v1/completions", completion(
            prompt=[PROMPT, PROMPT[:3]], logprobs=0, max_tokens=2))
        choices = json.loads(raw)["choices"]
        for c in choices:  # logprobs 0: the sampled token's alone
            lp = c["logprobs"]
            assert len(lp["tokens"]) == 2
            assert lp["top_logprobs"] == [{t: v} for t, v in zip(lp["tokens"],
                                                               lp["token_logprobs"])]
        assert choices[0]["logprobs"]["token_logprobs"] != choices[1]["logprobs"]["token_logprobs"]
    run(test, client=LogprobsClient())
