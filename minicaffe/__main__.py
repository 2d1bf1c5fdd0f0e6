"""``python -m minicaffe <command> <flags>``: the same as the ``minicaffe`` command."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
