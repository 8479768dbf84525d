"""The offline workloads' shapes, one table for bench_serving and for vLLM's side (vllm_preset.py
adds those offline_bench lacks to its own); standard library only, so that vLLM's environment
imports it too."""

WORKLOADS = {  # name: (requests, prompt range, output range)
    "W1": (256, (64, 1024), (32, 512)),
    "W2": (1000, (64, 1024), (32, 512)),
    "W3": (1024, (1536, 2048), (256, 1024)),
    # Short prompts, long outputs, hundreds of sequences at once: decode steps dominate, where
    # weight-only quantization pays (bench_online's decode-heavy lengths).
    "decode-heavy": (512, (64, 256), (512, 1024)),
    # One and sixteen sequences decoding 1,024 tokens each: tokens/s is the batch over a decode
    # step's time, so the same run quantized and in bf16 gives their steps' ratio on either side.
    "decode-1": (1, (128, 128), (1024, 1024)),
    "decode-16": (16, (64, 256), (1024, 1024)),
}
