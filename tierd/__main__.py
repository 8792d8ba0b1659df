"""``python -m tierd``: the same as the ``tierd`` command."""

from tierd.cli import main

raise SystemExit(main())
