"""CPU reference backend: the ops are the torch twins in pagedserve_kernels.reference, tensors on
CPU."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve_kernels import reference


class CpuBackend:
    name = "cpu"
    device = torch.device("cpu")
    pin_swap_memory = False

    reshape_and_cache = staticmethod(reference.reshape_and_cache)
    paged_prefill_attention = staticmethod(reference.paged_prefill_attention)
    paged_decode_attention = staticmethod(reference.paged_decode_attention)
    swap_blocks = staticmethod(reference.swap_blocks)
    copy_blocks = staticmethod(reference.copy_blocks)
    rms_norm = staticmethod(reference.rms_norm)
    fused_add_rms_norm = staticmethod(reference.fused_add_rms_norm)
    rotary_embedding = staticmethod(reference.rotary_embedding)
    rotary_embedding_and_cache = staticmethod(reference.rotary_embedding_and_cache)
    silu_and_mul = staticmethod(reference.silu_and_mul)
    gelu_tanh_and_mul = staticmethod(reference.gelu_tanh_and_mul)
    linear = staticmethod(F.linear)

    @staticmethod
    def check_model(config) -> None:
        """The reference twins compute every feature of every supported family."""
