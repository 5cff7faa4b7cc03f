"""eagleops' engine: everything but the UI, in layers that import only downwards.

``errors``, ``files`` and ``config`` at the bottom; ``protocol`` (events, commands, the control
socket, the one formatter) above them; ``generate`` (HTTP and files, no torch), ``training``
(the torch stages) and ``servers`` (loopback servers) beside each other; ``engine`` on top of
those; ``demo`` last. pyproject's import-linter contracts hold the rule.
"""
