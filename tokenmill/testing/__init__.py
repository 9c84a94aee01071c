"""Test tools that ship with the package (the engine core process must be able to import them)."""
