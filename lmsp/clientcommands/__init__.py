"""The client commands of ``lmsp``: one module per command; ``lmsp/cli.py`` parses the arguments."""
