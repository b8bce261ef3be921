"""``python -m loadgen.fleet SCENARIO`` (see :mod:`loadgen.fleet.run`)."""

from loadgen.fleet.run import main

raise SystemExit(main())
