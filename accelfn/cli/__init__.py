"""The ``accelfn`` command: ``launch``, ``config``, ``env`` (``commands.py``), ``test``
(``_selftest.py``, whose checks run in ``_selftest_worker.py``), and the launch configuration
it reads and writes (``config.py``: the record and its YAML file; ``precedence.py``: where each option comes from)."""

from accelfn.cli.commands import main

__all__ = ["main"]
