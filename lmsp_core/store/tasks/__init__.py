"""Tasks and their events in Redis: the task record, its claims and cancels (``records``), the
queue (``queue``) and its fair share between principals (``fairqueue``), the index of unfinished
tasks (``taskindex``), the stream of ended tasks (``finished``), appending events (``eventstore``),
reading them (``eventlog``) and what a log delivered (``delivered``)."""
