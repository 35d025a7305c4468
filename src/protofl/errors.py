"""The errors a user sees as one line: bad input (exit code 2) and a diverged run (exit 3)."""


class ProtoflError(Exception):
    """Bad input: config, data files or client payloads. The message is one line for the user."""

    exit_code = 2


class Diverged(ProtoflError):
    """The global model became non-finite; the run stopped and its last checkpoint is kept."""

    exit_code = 3
