"""`ssdlocal bench`: reproducible AR / SD / SSD benchmark against peers on the same weights.

Modules: prompts (prompt sets), run (our modes, interleaved, with exactness checks),
margin (target logit margin at a divergence), peers (transformers / llama.cpp),
aggregate (per-mode totals), project (pure speedup projections), report (JSON, Markdown,
PNG, environment facts). Nothing here prints; the CLI renders.
"""
