"""`python -m kvfsm.cli`: the `kvfsm` command."""

from kvfsm.cli import main

raise SystemExit(main())
