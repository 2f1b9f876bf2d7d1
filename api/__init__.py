"""The HTTP API: validates requests, stores them as tasks, relays their event logs."""
