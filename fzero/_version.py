"""fzero's version: a leaf module, importable from anywhere in the package without an import cycle."""

__version__ = "0.1.0"
