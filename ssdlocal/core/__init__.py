"""Core types every layer shares: configs, errors, events, sampling, verification,
per-row sequences, statistics and file locations. Imports nothing else of ssdlocal."""
