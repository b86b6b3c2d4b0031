"""The one exception type users see: a problem with their input or machine, said on one line."""


class GpuflowError(Exception):
    """Bad input or an unusable environment.

    The message is a single sentence that names the offending thing and says what to do;
    the CLI prints it as ``error: <message>`` and exits with status 2, without a traceback.
    """


class InterruptedAndSaid(KeyboardInterrupt):
    """Ctrl-C, after the command has said what it kept and how to go on: the CLI exits as
    for any interrupt but prints nothing more."""


def first_line(exc: BaseException) -> str:
    """An exception's message as one line for ours to quote: its first line, or its type's
    name where it says nothing."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
