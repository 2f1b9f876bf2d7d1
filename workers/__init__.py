"""Generation workers. The queue runtime lives at the top (the process, its arq jobs, each task's
run, the event writer, the reaper); the LMSP output path in ``output``, the batching engine in
``engine`` and the model in ``model``, which know nothing of the queue or the store."""
