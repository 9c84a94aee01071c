"""Structured output on llguidance: grammar.py turns a constraint into llguidance's grammar text and checks
it (caller's side); manager.py compiles, caches and advances matchers and fills the step's token bitmask
(engine core)."""
