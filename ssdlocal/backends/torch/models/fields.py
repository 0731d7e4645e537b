"""How a family reads a transformers config: rotary parameters in either of transformers'
layouts, and the refusal, by name, of a field whose value a family does not implement.
"""

from __future__ import annotations

from collections.abc import Sequence

from ssdlocal.weights.formats.archs import unsupported


def read_rope(rope: dict | None, cfg, arch: str, supported: Sequence[str] = ("default", "llama3", "linear")):
    """(theta, scaling) of rotary parameters as a config states them: transformers 5 keeps
    theta and scaling together (`rope_parameters`, or one entry of a per-layer-type dict:
    pass it as `rope`); 4.x split them (`rope_theta`, `rope_scaling`). A rope type outside
    `supported` is refused by name (UnsupportedArchitectureError)."""
    if rope is None:
        rope = getattr(cfg, "rope_parameters", None)
    if rope:
        theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
        scaling = dict(rope)
    else:
        theta = getattr(cfg, "rope_theta", 10000.0)
        scaling = dict(getattr(cfg, "rope_scaling", None) or {})
    scaling.pop("rope_theta", None)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in supported:
        raise unsupported(f"{arch} with rope_type={kind!r}")
    return float(theta), None if kind == "default" else {**scaling, "rope_type": kind}


def refuse(arch: str, cfg, **expected: object) -> None:
    """UnsupportedArchitectureError naming the first config field whose value is not the
    one we implement (`field=value` pairs; a missing field counts as expected)."""
    for name, want in expected.items():
        got = getattr(cfg, name, want)
        same = bool(got) == want if isinstance(want, bool) else (not got if want is None else got == want)
        if not same:
            raise unsupported(f"{arch} with {name}={got!r}")
