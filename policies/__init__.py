"""Pure decisions (no I/O, time injected): token bucket, cost, queueing, routing, shedding."""
