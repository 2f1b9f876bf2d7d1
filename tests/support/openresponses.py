"""What Open Responses' schema requires of the ``/v1/responses`` objects."""

# the fields its ResponseResource requires (its schema's `required`, some nullable): every response
# object of /v1/responses has them, in bodies and in lifecycle events alike
RESPONSE_RESOURCE = frozenset({
    "background", "completed_at", "created_at", "error", "frequency_penalty", "id", "incomplete_details",
    "instructions", "max_output_tokens", "max_tool_calls", "metadata", "model", "object", "output",
    "parallel_tool_calls", "presence_penalty", "previous_response_id", "prompt_cache_key", "reasoning",
    "safety_identifier", "service_tier", "status", "store", "temperature", "text", "tool_choice", "tools",
    "top_logprobs", "top_p", "truncation", "usage", "user"})
