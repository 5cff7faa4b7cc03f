"""The eagleops pipeline engine: no UI imports here (checked by tests/test_layering.py)."""
