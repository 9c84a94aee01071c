"""Speculative decoding: proposers and draft heads."""
