"""The ``lmsp`` command line."""
