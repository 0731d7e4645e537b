"""ssdlocal: exact local LLM generation with Speculative Speculative Decoding (SSD).

Importing this package does nothing heavy: torch, transformers and friends are
imported lazily by the modules that need them.
"""

__version__ = "0.1.0"
