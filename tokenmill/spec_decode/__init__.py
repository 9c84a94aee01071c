"""Speculative decoding: proposers, draft runner, draft heads and the adaptive policy."""
