"""The package version, importable from any layer without importing the package root."""

__version__ = "0.1.0"
