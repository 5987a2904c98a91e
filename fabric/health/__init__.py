"""Job health: one thread per rank, on one store connection, that publishes this rank's heartbeat and record,
shares preemption decisions, and acts on another rank's failure only on evidence.

What may end a rank here: a failure another rank recorded (the abort mark), where nothing else would end it.
Nothing is concluded from process ids (they mean nothing on another host or in another PID namespace) or from
another host's clock; a peer that left is no reason to end a rank that is not waiting for it.
"""
