"""``python -m pipeline.live``: the ``evhub-plan`` command."""

from pipeline.live.cli import main

raise SystemExit(main())
