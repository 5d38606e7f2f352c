"""hybrid_attn: filled by its paper issue."""
