"""The ``accelfn`` command: ``launch``, ``config``, ``env`` (``commands.py``), and the launch
configuration file it reads and writes (``config.py``)."""

from accelfn.cli.commands import main

__all__ = ["main"]
