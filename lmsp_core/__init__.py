"""Shared core of the LMSP service: wire types, settings, Redis keys, the task and event store.

Both the HTTP API (``api``) and the generation workers (``workers``) import this package;
it never imports torch or litestar.
"""
