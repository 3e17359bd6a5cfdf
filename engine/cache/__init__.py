"""The paged KV cache: byte layout per token and per request, and the fixed-size page pool."""
