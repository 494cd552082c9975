import sys

from rollserve.scheduler.server import main

if __name__ == "__main__":
    sys.exit(main())
