"""Command line: `python -m qtensor demo`."""

import sys


def main(argv=None) -> int:
    from qtensor.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
