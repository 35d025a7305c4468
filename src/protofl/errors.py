"""The one exception type that means "the user's input is wrong" (CLI exit code 2)."""


class ProtoflError(Exception):
    """Bad input: config, data files or client payloads. The message is one line for the user."""
