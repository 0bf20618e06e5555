"""`python -m flashtree ...`: the same CLI as the `flashtree` script."""

from flashtree.cli import main

raise SystemExit(main())
