"""`python -m rollserve.engine --model DIR [--port P] ...`: serve one engine (see server.py)."""

import sys

from rollserve.engine.server import main

if __name__ == "__main__":
    sys.exit(main())
