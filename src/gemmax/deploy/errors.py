"""The one anticipated failure type of the deploy package."""


class DeployError(RuntimeError):
    """A refused or failed deployment operation; the message says what happened and what to do."""
