"""Model definitions and weight loading for the worker."""
