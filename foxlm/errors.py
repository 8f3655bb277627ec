"""The error foxlm raises for a problem with what it was asked to do, as opposed to a bug in foxlm."""


class FoxlmError(ValueError):
    """A bad argument, an unreadable input or an output foxlm will not write: the message says what is wrong and what
    to do about it. The `foxlm` command prints it as one `error: ...` line (a traceback only with `--debug`)."""
