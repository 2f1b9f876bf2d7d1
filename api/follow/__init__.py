"""Following a task: the one owner of a client's time with a task (``streams``: the stream slot,
the submission, the history check, the wait for the final event, the cancel on disconnect) and
the frames each kind of stream sends (``framing``). The events come from the process's one reader
of event logs, ``api.eventhub``."""
