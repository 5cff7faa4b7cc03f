"""The console's themes (*.tcss), installed as ``console.themes`` and read through importlib.resources."""
