"""The version of accelfn (written into checkpoints and shown by ``accelfn --version``)."""

__version__ = "0.1.0"
