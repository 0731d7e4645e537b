"""Native PyTorch backend: our own Llama/Qwen2/Qwen3 forward pass over a static KV
cache with arbitrary (tree) attention masks, plus the safetensors/GGUF loader."""
