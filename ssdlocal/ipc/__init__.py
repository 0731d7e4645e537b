"""Child processes: one client for spawning and talking to a child (deadline receives,
broken flag, shutdown then kill), one serve loop, lifetime rules, and the q channel."""
