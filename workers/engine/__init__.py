"""The batching engine: sequences scheduled on a model's KV slots, one step at a time, on a thread of
their own. A library: token ids in, tokens out, no queue and no store."""
