"""The speculative decoding engine: decode state, tree building, the fused step and the generation loop."""
