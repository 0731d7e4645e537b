"""`ssdlocal bench`: reproducible AR / SD / SSD benchmark against peers on the same weights.

Modules: prompts (prompt sets), run (our modes, interleaved, with exactness checks),
margin (target logit margin at a divergence), peers (transformers / llama.cpp),
aggregate (per-mode totals), project (pure speedup projections), report (JSON, Markdown,
PNG, environment facts). The concurrent-clients workload: clients (what agents, editors and
chats send), stream (one timed streamed request), servers (servers as child processes),
concurrent (run and summarise), report_concurrent (its JSON and Markdown). Nothing here
prints; the CLI renders.
"""
