"""Structured output on llguidance: grammar.py turns a constraint into llguidance's grammar text and checks
it (caller's side); limits.py holds the limits every grammar must meet before llguidance sees it; isolation.py
runs the caller's check in a worker process (checker_worker.py: a grammar that crashes llguidance costs a 400,
never the server); threads.py gives the compiles that stay in process a known stack; checker.py re-exports
those three's public names; manager.py compiles, caches and advances matchers and fills the step's token
bitmask (engine core)."""
