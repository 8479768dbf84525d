"""The two grammar engines vLLM offers, xgrammar and llguidance, measured on the host as pagedserve
would use them: does importing one pull in torch (the scheduler must not), tokenizer set-up, cold
compile time of typical specs, and the time to fill one row's token bitmask at each step of a
valid output, at SmolLM2's vocabulary (49,152) and a 150k one (SmolLM2's extended with merges).

    python benchmarks/bench_grammar.py [--engines llguidance xgrammar] [--repeats 3]

Times are the process's CPU time (a shared machine's waiting for a core is not the engine's);
xgrammar compiles on one thread, as llguidance does.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "scheduler_svc"))

SMALL = {"type": "object", "properties": {"name": {"type": "string"},
                                          "age": {"type": "integer", "minimum": 0,
                                                  "maximum": 150}},
         "required": ["name", "age"], "additionalProperties": False}
NESTED = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1},
        "status": {"enum": ["open", "closed", "pending"]},
        "owner": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 40},
            "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"}},
            "required": ["name", "email"], "additionalProperties": False},
        "scores": {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 1},
                   "minItems": 1, "maxItems": 5},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["id", "status", "owner", "scores", "tags"], "additionalProperties": False,
}
WIDE = {"type": "object", "properties": {f"field_{i}": ({"type": "integer"} if i % 3 == 0 else
                                                         {"type": "string"} if i % 3 == 1 else
                                                         {"type": "boolean"})
                                         for i in range(30)},
        "required": [f"field_{i}" for i in range(30)], "additionalProperties": False}
CASES = {
    "json small": ("json", SMALL, {"name": "Ada Lovelace", "age": 36}),
    "json nested": ("json", NESTED, {"id": 7, "status": "open",
                                     "owner": {"name": "Bob", "email": "bob@example.com"},
                                     "scores": [0.5, 0.25, 1], "tags": ["x", "yz"]}),
    "json 30 fields": ("json", WIDE, {f"field_{i}": (i if i % 3 == 0 else f"v{i}" if i % 3 == 1
                                                     else True) for i in range(30)}),
    "regex date": ("regex", r"\d{4}-\d{2}-\d{2}", "2024-05-17"),
    "regex email": ("regex", r"[a-z0-9._]+@[a-z0-9]+\.(com|org|net)", "jane.doe@mail.org"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", nargs="+", default=["llguidance", "xgrammar"])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    for engine in args.engines:
        print(f"{engine}: import pulls torch: {_imports_torch(engine)}")
    hf_small = _smollm2()
    tokenizers = {"49k": hf_small, "150k": _extended(hf_small, 150_000)}
    for name, hf in tokenizers.items():
        for engine in args.engines:
            _bench(engine, name, hf, args.repeats)


def _imports_torch(engine: str) -> bool:
    code = f"import sys, {engine}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return out.stdout.strip() == "True"


def _smollm2():
    from sched_factories import smollm2_gguf_path
    from scheduler_svc.tokenizer import load_tokenizer
    return load_tokenizer(smollm2_gguf_path()).hf_tokenizer


def _extended(hf, vocab_size: int):
    """hf's BPE with merges of random token pairs added until vocab_size: a real trie's shape."""
    from transformers import PreTrainedTokenizerFast
    spec = json.loads(hf.backend_tokenizer.to_str())
    vocab, merges = spec["model"]["vocab"], spec["model"]["merges"]
    base = [t for t in vocab if len(t) > 1]
    rng = random.Random(0)
    next_id = max(max(vocab.values()), *(t["id"] for t in spec["added_tokens"])) + 1
    while next_id < vocab_size:
        a, b = rng.choice(base), rng.choice(base)
        if a + b in vocab:
            continue
        vocab[a + b] = next_id
        merges.append([a, b] if merges and isinstance(merges[0], list) else f"{a} {b}")
        next_id += 1
    from tokenizers import Tokenizer
    out = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)))
    out.eos_token = hf.eos_token
    return out


def _cpu() -> float:
    return time.process_time()


def _bench(engine: str, vocab_name: str, hf, repeats: int) -> None:
    make = _llguidance if engine == "llguidance" else _xgrammar
    start = _cpu()
    compile_fn, walk_fn, row_bytes = make(hf)
    setup_s = _cpu() - start
    print(f"\n{engine} at {vocab_name} ({len(hf)} tokens): tokenizer set-up {setup_s:.2f} s, "
          f"mask {row_bytes} B/row")
    for case, (kind, spec, instance) in CASES.items():
        text = json.dumps(instance, separators=(",", ":")) if kind == "json" else instance
        ids = hf(text).input_ids
        compiles, masks = [], []
        for _ in range(repeats):
            start = _cpu()
            compiled = compile_fn(kind, spec)
            compiles.append(_cpu() - start)
            masks += walk_fn(compiled, ids)
        masks.sort()
        print(f"  {case:15s} compile {statistics.median(compiles) * 1e3:8.2f} ms   "
              f"mask/token mean {statistics.mean(masks) * 1e6:7.1f} us   "
              f"p99 {masks[int(0.99 * (len(masks) - 1))] * 1e6:7.1f} us   "
              f"max {masks[-1] * 1e6:7.1f} us   ({len(ids)} tokens)")


def _llguidance(hf):
    import llguidance
    import llguidance.numpy as lln
    tok = llguidance.LLTokenizer(hf.backend_tokenizer.to_str(), n_vocab=len(hf),
                                 eos_token=hf.eos_token_id)
    bitmask = lln.allocate_token_bitmask(1, len(hf))

    def compile_fn(kind, spec):
        grammar = (llguidance.LLMatcher.grammar_from_json_schema(spec) if kind == "json"
                   else llguidance.LLMatcher.grammar_from_regex(spec))
        matcher = llguidance.LLMatcher(tok, grammar)
        lln.fill_next_token_bitmask(matcher, bitmask, 0)  # the first mask builds the lexer
        assert not matcher.is_error(), matcher.get_error()
        return grammar

    def walk_fn(grammar, ids):
        matcher, times = llguidance.LLMatcher(tok, grammar), []
        for t in ids:
            start = _cpu()
            lln.fill_next_token_bitmask(matcher, bitmask, 0)
            times.append(_cpu() - start)
            assert bitmask[0, t // 32] >> (t % 32) & 1, "token not allowed"
            assert matcher.consume_token(t), matcher.get_error()
        return times

    return compile_fn, walk_fn, bitmask.nbytes


def _xgrammar(hf):
    import xgrammar as xgr
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=len(hf))
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    bitmask = xgr.allocate_token_bitmask(1, len(hf))

    def compile_fn(kind, spec):
        if kind == "json":
            return compiler.compile_json_schema(json.dumps(spec), any_whitespace=False,
                                                separators=(",", ":"))
        return compiler.compile_regex(spec)

    def walk_fn(compiled, ids):
        matcher, times = xgr.GrammarMatcher(compiled), []
        for t in ids:
            start = _cpu()
            matcher.fill_next_token_bitmask(bitmask, 0)
            times.append(_cpu() - start)
            assert int(bitmask[0, t // 32]) >> (t % 32) & 1, "token not allowed"
            assert matcher.accept_token(t)
        return times

    return compile_fn, walk_fn, bitmask.numel() * 4


if __name__ == "__main__":
    main()
