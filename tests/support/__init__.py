"""What the tests share, so that no test module imports another's helpers.

Tiny checkpoints and files: tiny_models (random Llama/Qwen2/Qwen3 checkpoints and one
tokenizer; conftest.py's `tiny_dir` builds them once per session), tiny_gguf (GGUF files,
quantized mixes and an F32 Qwen2), renamed_arch (an architecture under other names).
Fakes: scripted (a Runner over a table of logits, and a table drafter: the engine's round,
prefill and drafters without a model), fake_engine (the TUI's engine), fake_cuda (CUDA
tensors on a CPU), hub and wheels (a Hugging Face hub, PyPI wheels and pip), fake_llama_cpp
(a llama-cpp-python stand-in), grammar_children (a grammar child that hangs on demand).
Harnesses: cli (the CLI in-process), server (a live `ssdlocal serve`), processes (children
in /proc, interrupting a streaming CLI), stats (chi-square), exact (the exact joint
distribution of three tokens), host_reads (tensor -> Python reads), quant (dequantized
copies), devices (machines for placement), drafts (drafts from option text), tui (async
Textual tests). fixtures: the fixtures conftest.py shares with every module.
"""
