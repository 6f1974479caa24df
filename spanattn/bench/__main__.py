"""``python -m spanattn.bench``: the benchmark without the ``spanattn`` command."""

import argparse
import sys

from . import add_arguments, main

if __name__ == "__main__":  # not when a doctest collector imports every module
    parser = argparse.ArgumentParser(prog="python -m spanattn.bench", description=__doc__)
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
