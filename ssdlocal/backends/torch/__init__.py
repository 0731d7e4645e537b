"""Native PyTorch backend: our own Llama/Qwen2/Qwen3 forward pass over a static KV
cache with arbitrary (tree) attention masks, its loader and its int8/int4 quantizer; the
model files themselves are read through ssdlocal.weights.formats."""
