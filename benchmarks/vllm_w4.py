"""vLLM on W4 (benchmarks/RESULTS.md), for a side-by-side ratio with bench_serving.py --workload W4
measured in the same call on the same GPU; side_by_side.py runs it.

    python3 benchmarks/vllm_w4.py [--out FILE.json] [--max-num-seqs N] [--max-num-batched-tokens N]
                                  [--conversations N --turns N ...] [--dry]

Runs in the GPU machine's vLLM environment as ../shared/bench/vllm/offline_bench.py does: vLLM from
/tmp/vllm_site ($VLLM_SITE overrides) on this process's path only, Llama-3-8B shape, bf16, dummy
weights, no tokenizer. The conversations come from conversations.py, as bench_serving builds them;
a round is one llm.generate() of every conversation's next turn (prefix caching on, greedy, EOS
ignored, min_tokens = max_tokens), and each round's output ids join the next round's prompts.
Reports output tokens/s over all rounds, TTFT p50/p99 (vLLM's first_token_latency, stats on) and
the prefix cache's hit rate (num_cached_tokens over prompt tokens), as a RESULT line and JSON in
offline_bench's layout. --dry prints W4's sizes without vLLM or a GPU.
"""
import argparse
import json
import os
import shutil
import sys
import tempfile
import time

from conversations import (ConversationRounds, add_arguments, percentile,  # this folder
                           spec_from_args, turn_lengths)

VOCAB = 128256
CONFIG = {  # Llama-3-8B, as offline_bench.py; 8192 positions hold W4's longest turn (5,115)
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "intermediate_size": 14336, "vocab_size": VOCAB, "rope_theta": 500000.0,
    "max_position_embeddings": 8192, "torch_dtype": "bfloat16", "hidden_act": "silu",
    "rms_norm_eps": 1e-5, "bos_token_id": 128000, "eos_token_id": 128001,
    "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
}
MAX_MODEL_LEN = 8192
ENV_DEFAULTS = {  # offline_bench.py's: without the first, the engine fails to start (no flashinfer)
    "VLLM_USE_FLASHINFER_SAMPLER": "0", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
}


def use_vllm_site() -> None:
    site = os.environ.get("VLLM_SITE", "/tmp/vllm_site")
    if os.path.isdir(site):  # for this process and the engine processes it starts
        sys.path.insert(0, site)
        os.environ["PYTHONPATH"] = os.pathsep.join(
            filter(None, [site, os.environ.get("PYTHONPATH")]))
    for k, v in ENV_DEFAULTS.items():
        os.environ.setdefault(k, v)


def dry(spec) -> None:
    lengths = turn_lengths(spec, VOCAB)
    turns = [t for row in lengths for t in row]
    print(f"W4: conversations={spec.conversations} turns={spec.turns} requests={len(turns)} "
          f"prompt_tokens={sum(p for p, _ in turns)} output_tokens={sum(o for _, o in turns)} "
          f"longest_request={max(p + o for p, o in turns)} max_model_len={MAX_MODEL_LEN}")


def run_rounds(llm, spec) -> dict:
    """Every conversation's turn k in one llm.generate, k = 0, 1, ...; W4's figures."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    rounds = ConversationRounds(spec, VOCAB)
    prompt_tokens = cached = produced = full = 0
    ttft, round_walls = [], []
    start = time.perf_counter()
    for k in range(spec.turns):
        t = time.perf_counter()
        requests = rounds.requests(k)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p, _ in requests],
                            [SamplingParams(temperature=0, max_tokens=o, min_tokens=o,
                                            ignore_eos=True, detokenize=False)
                             for _, o in requests], use_tqdm=False)
        rounds.add_outputs(k, [list(r.outputs[0].token_ids) for r in outs])
        round_walls.append(round(time.perf_counter() - t, 3))
        for r, (prompt, o) in zip(outs, requests):
            n = len(r.outputs[0].token_ids)
            produced, full = produced + n, full + (n == o)
            prompt_tokens, cached = prompt_tokens + len(prompt), cached + (r.num_cached_tokens or 0)
            if r.metrics is not None and getattr(r.metrics, "first_token_latency", 0) > 0:
                ttft.append(r.metrics.first_token_latency)
    wall = time.perf_counter() - start
    n = spec.conversations * spec.turns
    return dict(requests=n, conversations=spec.conversations, turns=spec.turns,
                system_tokens=spec.system_tokens, prompt_tokens=prompt_tokens,
                output_tokens=produced, full_outputs=full, wall_s=round(wall, 3),
                output_tok_s=round(produced / wall, 1), round_wall_s=round_walls,
                ttft_p50_s=percentile(ttft, 50) if ttft else None,
                ttft_p99_s=percentile(ttft, 99) if ttft else None, ttft_count=len(ttft),
                prefix_cache_queries=prompt_tokens, prefix_cache_hits=cached,
                prefix_cache_hit_rate=cached / prompt_tokens if prompt_tokens else 0.0)


def start_engine(args):
    """The engine (prefix caching on; stats on unless --no-stats, for TTFT), and its settings."""
    import vllm
    from vllm import LLM

    model_dir = tempfile.mkdtemp(prefix="llama3_8b_dummy_")
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(CONFIG, f, indent=1)
    engine_args = dict(model=model_dir, load_format="dummy", dtype="bfloat16",
                       max_model_len=MAX_MODEL_LEN, gpu_memory_utilization=0.9,
                       enable_prefix_caching=True, seed=0, skip_tokenizer_init=True,
                       disable_log_stats=args.no_stats)
    if args.max_num_seqs:
        engine_args["max_num_seqs"] = args.max_num_seqs
    if args.max_num_batched_tokens:
        engine_args["max_num_batched_tokens"] = args.max_num_batched_tokens
    print(f"vllm {vllm.__version__}, engine args {engine_args}", flush=True)
    t0 = time.perf_counter()
    llm = LLM(**engine_args)
    return llm, model_dir, engine_args, time.perf_counter() - t0


def warm_up(llm) -> None:
    """offline_bench.py's warm-up: two short random prompts, sharing nothing with W4."""
    import random

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    rng = random.Random(123)
    prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(1, VOCAB) for _ in range(n)])
               for n in (32, 200)]
    params = SamplingParams(temperature=0, max_tokens=16, min_tokens=16, ignore_eos=True,
                            detokenize=False)
    llm.generate(prompts, [params, params], use_tqdm=False)


def engine_settings(llm) -> dict:
    cfg = llm.llm_engine.vllm_config
    fields = {"max_num_seqs": (cfg.scheduler_config, "max_num_seqs"),
              "max_num_batched_tokens": (cfg.scheduler_config, "max_num_batched_tokens"),
              "enable_prefix_caching": (cfg.cache_config, "enable_prefix_caching"),
              "num_gpu_blocks": (cfg.cache_config, "num_gpu_blocks"),
              "block_size": (cfg.cache_config, "block_size"),
              "cudagraph_mode": (cfg.compilation_config, "cudagraph_mode")}
    return {k: str(getattr(obj, attr, "n/a")) for k, (obj, attr) in fields.items()}


def gpu_name() -> str:
    try:  # through NVML, so this process opens no CUDA context of its own
        from vllm.platforms import current_platform
        return current_platform.get_device_name()
    except Exception as err:  # noqa: BLE001  (a missing name must not cost the measurement)
        return f"unknown ({err!r})"


def stop_engine(llm) -> None:
    """End the engine's processes so that a benchmark run after this one gets the GPU."""
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception as err:  # noqa: BLE001  (reported; the results are already written)
        print(f"engine shutdown: {err!r}", flush=True)
    import psutil
    children = psutil.Process().children(recursive=True)
    for c in children:
        c.terminate()
    for c in psutil.wait_procs(children, timeout=15)[1]:
        c.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help="vLLM's default: 1024 on an H200")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="vLLM's default: 16384")
    ap.add_argument("--no-stats", action="store_true",
                    help="vLLM's offline default (disable_log_stats): no TTFT then")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--dry", action="store_true", help="print W4's sizes only (no GPU, no vLLM)")
    add_arguments(ap)
    args = ap.parse_args()
    spec = spec_from_args(args)
    if args.dry:
        dry(spec)
        return
    use_vllm_site()
    import vllm

    llm, model_dir, engine_args, init_s = start_engine(args)
    settings = engine_settings(llm)
    print(f"ENGINE start {init_s:.1f} s, {json.dumps(settings)}", flush=True)
    warm_up(llm)
    results = {"vllm": vllm.__version__, "gpu": gpu_name(),
               "engine_args": {k: str(v) for k, v in engine_args.items()},
               "engine_start_s": round(init_s, 1), "settings": settings, "workloads": {}}
    r = results["workloads"]["W4"] = run_rounds(llm, spec)
    print(f"RESULT W4 output_tok_s={r['output_tok_s']} wall_s={r['wall_s']} "
          f"requests={r['requests']} prompt_tokens={r['prompt_tokens']} "
          f"output_tokens={r['output_tokens']} full_outputs={r['full_outputs']}/{r['requests']} "
          f"ttft_p50_s={r['ttft_p50_s']} ttft_p99_s={r['ttft_p99_s']} "
          f"prefix_cache_hit_rate={r['prefix_cache_hit_rate']:.3f}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    stop_engine(llm)
    shutil.rmtree(model_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
