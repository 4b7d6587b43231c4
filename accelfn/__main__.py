"""``python -m accelfn launch | config | env | test``: the same as the ``accelfn`` command."""

from accelfn.cli.commands import console

console()
