"""textclf: the library under train.py (docs/development.md lists its files)."""
