"""`python -m tokenmill ...` runs the `tokenmill` command."""
import sys

from tokenmill.cli import main

# Guarded: the engine core and workers are spawned processes, which import the main module again.
if __name__ == "__main__":
    sys.exit(main())
