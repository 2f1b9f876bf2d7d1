"""Following a task: the one owner of a client's time with a task (``streams``: the stream slot,
the submission, the history check, the wait for the final event, the cancel on disconnect), the
shared reader of event logs (``hub``), and the frames each kind of stream sends (``framing``)."""
