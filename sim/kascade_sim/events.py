"""Event kinds on the simulator's heap (one heap, ordered by time, then by a sequence number)."""

ITER, ACCEPT, READY, TICK, KV = 0, 1, 2, 3, 4  # iteration end, may serve, all blocks in, policy tick, KV arrived
