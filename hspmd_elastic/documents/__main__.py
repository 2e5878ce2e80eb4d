"""``python -m hspmd_elastic.documents make|check ...``: the data CLI (``documents_cli.main``),
a module of its own so the library (``hspmd_elastic.documents``) never imports its CLI."""

from hspmd_elastic.documents_cli import main

raise SystemExit(main())
