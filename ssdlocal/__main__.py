"""`python -m ssdlocal`: the CLI entry point.

The guard matters: the SSD draft worker is started with the `spawn` method, which
re-imports the main module in the child; the CLI must not run again there.
"""

from ssdlocal.cli.app import main

if __name__ == "__main__":
    main()
