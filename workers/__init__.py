"""Generation workers: load models, take tasks from the queue, generate, append events."""
