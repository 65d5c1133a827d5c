"""Model definitions: the Qwen3.5/3.6 hybrid target and the DFlash drafter."""
