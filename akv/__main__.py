"""``python -m akv`` runs the CLI."""

from akv.cli import main

raise SystemExit(main())
