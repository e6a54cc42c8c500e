"""The package's version, in the base layer so that any module can name it without
importing the package's facade."""

__version__ = "0.1.0"
