"""A module that fails as it is imported: a class path into it is a configuration error,
and a configuration with errors in its trainer section never imports it."""

raise RuntimeError("this module fails to import")
