"""Model files as files: what every backend, the planner and the pair checks read from them.

The architecture table (`arch.py`: how checkpoints and GGUF files name each model and its
tensors), GGUF headers and rows (`gguf.py`), safetensors files one tensor at a time
(`safetensors.py`), the checks a checkpoint passes before anything is built from it
(`checks.py`), a checkpoint's config, tokenizer and weight files (`checkpoint.py`), a GGUF's
float conversion (`convert.py`) and metadata directory (`metadata.py`), and what a quantized
checkpoint is (`quantized.py`). Nothing here runs a model; the submodules are imported one by
one (`safetensors.py` imports torch, the rest import it only inside conversions).
"""
