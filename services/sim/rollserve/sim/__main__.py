"""`python -m rollserve.sim engine|fleet ...`: serve simulated engines (see server.py)."""

import sys

from rollserve.sim.server import main

if __name__ == "__main__":
    sys.exit(main())
