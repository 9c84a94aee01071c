"""Structured output on llguidance: grammar.py turns a constraint into llguidance's grammar text and checks
it (caller's side); checker.py holds the limits every grammar must meet before llguidance sees it and runs the
caller's check in a worker process (a grammar that crashes llguidance costs a 400, never the server);
manager.py compiles, caches and advances matchers and fills the step's token bitmask (engine core)."""
