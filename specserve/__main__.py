"""`python -m specserve ...`: the `specserve` command (`specserve.cli`), for an environment
whose scripts folder is not on PATH."""

import sys

from specserve.cli import main

if __name__ == "__main__":
    sys.exit(main())
