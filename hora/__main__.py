"""``python -m hora``: the same command line as the ``hora`` console script."""
import sys

from hora.runner.cli import main

if __name__ == "__main__":
    sys.exit(main())
