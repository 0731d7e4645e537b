"""Model backends: native torch models, llama.cpp (GGUF) and n-gram proposers."""
