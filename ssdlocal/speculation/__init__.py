"""Pure speculation policy: the n-gram proposer, Saguaro fan-out, the backup chooser and
the speculation cache. Knows nothing about models, processes or devices."""
