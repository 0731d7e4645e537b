"""Multi-device support: tensor parallelism applied to a loaded target (tp.py), the rank
processes that mirror rank 0's forwards (group.py), device-list parsing (devices_arg.py)
and the choice of the target <-> draft channel for q (channel.py).

Nothing here is imported by the model code; the engine uses it only when a target is
given more than one device.
"""
