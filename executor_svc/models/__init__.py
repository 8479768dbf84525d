"""Model implementations over the paged KV cache (Llama family)."""
