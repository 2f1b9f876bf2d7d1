"""Everything kept in Redis: keys, scripts, tasks and their event logs, the queue, registries,
credentials, metrics, connections."""
