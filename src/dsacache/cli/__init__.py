"""The ``dsacache`` command line (``dsacache.cli.main:main``)."""
