"""DeepSeek-V4 in plain PyTorch: the engine's ground truth, checked against transformers."""
