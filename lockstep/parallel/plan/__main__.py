"""``python -m lockstep.parallel.plan``: the ``lockstep plan`` command."""

from lockstep.parallel.plan.cli import main

raise SystemExit(main())
