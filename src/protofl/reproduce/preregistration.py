"""The pre-registration (``prereg``), written before the runs it plans; never edited after."""

PREREGISTERED: tuple[dict, ...] = ()
