"""The one exception type users see: the CLI prints its message without a traceback."""


class EyasError(Exception):
    """A user-facing error. The message names the input, what was wrong and what to do."""


class NonFiniteError(EyasError):
    """Training produced non-finite losses, gradients or weights; or a draft holds them."""
