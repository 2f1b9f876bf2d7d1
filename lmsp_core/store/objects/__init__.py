"""What clients create beside tasks: stored responses and their conversations (``conversations``),
files (``files``: OpenAI's Files API, in chunks), batches (``batches``) and webhook endpoints with
their deliveries (``webhooks``)."""
