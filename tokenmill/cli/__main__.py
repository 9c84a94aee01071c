"""`python -m tokenmill.cli`, as the `tokenmill` console script."""
import sys

from tokenmill.cli import main

sys.exit(main())
