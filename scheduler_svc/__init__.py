"""scheduler_svc: the CPU-only side of pagedserve (API, sequences, page tables, policy, stop rules).

Must never import torch, cupy, `pagedserve_kernels` or `executor_svc`.
"""
