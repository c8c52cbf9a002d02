"""Error types that the CLI turns into one-line messages and exit codes."""

MAX_MESSAGE = 600  # characters of one error line


class PruneOpsError(Exception):
    """Base class of every error a stage reports to the user (exit code 1).

    The message is kept to one line: line breaks from user input (a key, a value, a file's text)
    are written as an escaped backslash-n, and it is cut at `MAX_MESSAGE` characters.
    """

    exit_code = 1

    def __init__(self, message: str = "", *args: object):
        text = str(message).replace("\r", "\\r").replace("\n", "\\n")
        if len(text) > MAX_MESSAGE:  # a value or a file's text inside the message is cut, not echoed whole
            text = f"{text[: MAX_MESSAGE - 40]}… ({len(text) - MAX_MESSAGE + 40} more characters)"
        super().__init__(text, *args)


class ConfigError(PruneOpsError):
    """A parameter is unknown, of the wrong type or out of range (exit code 2)."""

    exit_code = 2


class DataError(PruneOpsError):
    """Input data is missing, unreadable or malformed."""


class DataValidationError(DataError):
    """The data failed its expectation suite.

    Args:
        summary: One line naming the failed expectations.
        details: One line per failed expectation, for the report printed below the summary.
    """

    def __init__(self, summary: str, details: list[str]):
        super().__init__(summary)
        self.details = details


class CheckpointError(PruneOpsError):
    """A checkpoint is missing, corrupt or does not fit its architecture."""


class ParityError(PruneOpsError):
    """An exported model disagrees with its PyTorch source beyond tolerance."""


class QualityGateError(PruneOpsError):
    """No candidate meets the accuracy tolerance the stage was given."""


class LatencyGateError(PruneOpsError):
    """No plan measured fast enough against dense: nothing slower ships."""
