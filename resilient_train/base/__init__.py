"""The base every package stands on: exit codes, config files and config trees, safe files, lazy names, flags.

Nothing here imports anything of the project outside ``resilient_train.base``, and importing it is cheap
(``resilient_train/__init__.py`` loads its names lazily): the lower packages (``checkpointing``, ``monitors``,
``chaos``) import the runtime through this package only (tests/test_layout.py).
"""

__all__: list[str] = []
