"""``python -m loadgen``: see :mod:`loadgen.cli`."""

from loadgen.cli import main

main()
