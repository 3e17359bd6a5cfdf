"""Engine tools: the deterministic tiny checkpoint and tokenizer used by tests and the console demo."""
