"""The engine's OpenAI-compatible HTTP side: chat encoding, DSML tool-call parsing and the API itself."""
