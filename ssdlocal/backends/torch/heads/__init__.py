"""Draft heads: small networks that draft from the target's hidden states (EAGLE-3), with
their own one-layer KV cache (runner.py). A head is loaded beside the target and shares its
token embeddings; what it drafts is verified like any draft, so a head changes speed, never
the output."""
