"""The engine core: scheduler, KV block pool, request state and the step contract. No torch."""
