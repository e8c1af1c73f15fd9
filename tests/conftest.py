"""Shared pytest setup.

pytest (rootdir-based "prepend" imports, no `__init__.py` in tests/) puts this folder on
`sys.path` when it loads this file, which lets test files `from tiny_models import ...`.
"""
