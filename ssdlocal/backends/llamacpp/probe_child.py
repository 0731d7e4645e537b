"""The probe's child process: load the tiny probe model with llama.cpp the way the runner
does (LlamaLib, with torch loaded as in the engine's process) and evaluate a few tokens.

    python -m ssdlocal.backends.llamacpp.probe_child MODEL.gguf --extra-bufts on|off

Prints one JSON line: {"ok": true, "tokens": [...]} after a prompt of 8 tokens and 3
single-token steps with finite logits; {"ok": false, "error": ...} (exit 1) for a
Python-level failure; {"ok": false, "unsupported": true} (exit 3) when this
llama-cpp-python cannot turn extra buffer types off. A native crash kills the process,
which is what probe.py watches for.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

_PROMPT = [72, 101, 108, 108, 111, 32, 119, 111]  # bytes of "Hello wo" in the probe vocabulary


def _say(**fields) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def evaluate(lib, path: str, threads: int) -> list[int]:
    """Load, decode the prompt in one batch, then 3 tokens one at a time; the tokens."""
    model = lib.load_model(path, 0, 0)
    ctx = lib.new_context(model, n_ctx=64, n_batch=32, n_seq_max=1, n_threads=threads)
    try:
        n_vocab = lib.n_vocab(model)
        n = len(_PROMPT)
        logits = lib.decode(ctx, _PROMPT, list(range(n)), [0] * n, [True] * n, n_vocab)  # [8, V]
        out: list[int] = []
        for step in range(3):
            if logits.shape[-1] != n_vocab or not np.isfinite(logits).all():
                raise RuntimeError(f"llama.cpp returned non-finite or misshapen logits {logits.shape}")
            out.append(int(logits[-1].argmax()))
            logits = lib.decode(ctx, [out[-1]], [n + step], [0], [True], n_vocab)  # [1, V]
        return out
    finally:
        lib.free_context(ctx)
        lib.free_model(model)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="llama.cpp probe (run by ssdlocal)")
    ap.add_argument("model")
    ap.add_argument("--extra-bufts", choices=("on", "off"), default="on")
    args = ap.parse_args(argv)
    import torch  # the engine's process has torch loaded whenever llama.cpp runs

    from ssdlocal.backends.llamacpp.lib import LlamaLib, can_disable_extra_bufts
    from ssdlocal.core.errors import SSDLocalError

    try:
        lib = LlamaLib(verbose=False, extra_bufts=args.extra_bufts == "on")
        if not lib.extra_bufts and not can_disable_extra_bufts(lib.ll):
            _say(ok=False, unsupported=True, error="this llama-cpp-python has no use_extra_bufts")
            return 3
        tokens = evaluate(lib, args.model, max(1, torch.get_num_threads()))
    except (SSDLocalError, RuntimeError, OSError, ValueError) as exc:
        _say(ok=False, error=str(getattr(exc, "message", exc)))
        return 1
    _say(ok=True, tokens=tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
