"""Flag names and the error that names one (no imports: everything may use them)."""


class ConfigError(ValueError):
    """A bad engine argument; the message names the flag."""


def flag_of(name: str) -> str:
    """``page_size`` -> ``--page-size``."""
    return "--" + name.replace("_", "-")
