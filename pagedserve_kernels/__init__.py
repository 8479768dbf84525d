"""pagedserve kernels: CUDA sources compiled with cupy.RawModule, one launcher per family, torch
reference twins with the same signatures, and `warmup` / `arch_used`. Nothing here imports cupy
or touches a GPU at import time; `graph_capture` is how the services capture CUDA graphs.
"""
from pagedserve_kernels._compile import arch_used, graph_capture, warmup

__all__ = ["arch_used", "graph_capture", "warmup"]
