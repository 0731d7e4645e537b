"""Multi-device support for the target.

tp.py applies tensor parallelism to a loaded Transformer; shard_loader.py reads one
rank's slices from safetensors; group.py (rank 0, in the engine's process) and rank.py
(the other ranks' processes) run the sharded model in lockstep; devarg.py parses
`cuda:0-3`; auto.py asks the planner (devices.py) for `--target-devices auto`;
channel.py chooses how q travels from the SSD draft worker (CUDA IPC or shared memory).
Nothing here is imported by the model code or at engine import time.
"""
