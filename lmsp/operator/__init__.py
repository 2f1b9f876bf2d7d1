"""The operator's commands: they talk to the service's Redis directly, not to an API, and need the
service's packages (extra ``api``): bearer tokens (``tokens``: ``lmsp token``), principals'
settings (``principals``: ``lmsp principal``), webhook endpoints (``webhooks``: ``lmsp webhook``),
and what they share (``redisaccess``)."""
