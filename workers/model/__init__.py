"""Loading a model and running its step on KV slots: the slot decoder for Llama-family models, the
fallback through transformers' forward pass, and the weights' forms this host multiplies fastest."""
