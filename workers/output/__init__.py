"""The LMSP output path: a sequence's tokens become text, a reasoning section, stop strings, output
items and their events; and the grammar masks that keep the tokens valid for it."""
