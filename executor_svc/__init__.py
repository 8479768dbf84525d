"""executor_svc: the GPU side of pagedserve (weights, forward pass, paged KV cache, swap space,
sampling) behind a step protocol. Never imports scheduler_svc; pagedserve_kernels only through a
backend.
"""
