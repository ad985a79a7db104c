"""The runtime every pagedserve process shares: the queue client over Redis (connect, producer,
replies, mailbox, ``QueueClient``), supervision of background tasks, logging, the environment and
the installed version, the workers' metric names, and the structured-output grammar text."""
