"""Constrained decoding: grammars compiled against the target's vocabulary (compiler.py)
and the per-call matchers that mask the target's p at every verified position (guide.py).

Knows nothing of models, drafters or HTTP; the engine hands a `Guides` its rows' tokens and
applies the masks it returns.
"""
