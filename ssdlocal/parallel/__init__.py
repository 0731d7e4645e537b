"""Tensor-parallel targets: one model split over several devices, one process per rank.

tp.py applies tensor parallelism to a loaded model; shard_loader.py reads one
rank's slices from safetensors; group.py (rank 0, in the engine's process) and rank.py
(the other ranks' processes, ipc children) run the sharded model in lockstep.
Nothing here is imported by the model code or at engine import time.
"""
