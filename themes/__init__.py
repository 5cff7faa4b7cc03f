"""The console's themes (*.tcss), installed as ``eagleops.themes`` and read through importlib.resources."""
