"""The one exception type users see: a problem with their input or machine, said on one line."""


class GpuflowError(Exception):
    """Bad input or an unusable environment.

    The message is a single sentence that names the offending thing and says what to do;
    the CLI prints it as ``error: <message>`` and exits with status 2, without a traceback.
    """


class InterruptedAndSaid(KeyboardInterrupt):
    """Ctrl-C, after the command has said what it kept and how to go on: the CLI exits as
    for any interrupt but prints nothing more."""
