"""The one exception type users see, and the one warning type: the CLI prints either's message
without a traceback or a source line."""

from __future__ import annotations

import sys
import warnings


class EyasError(Exception):
    """A user-facing error. The message names the input, what was wrong and what to do."""


class NonFiniteError(EyasError):
    """Training produced non-finite losses, gradients or weights; or a draft holds them."""


class EyasWarning(UserWarning):
    """A user-facing warning: something the run goes on with but the user should know, and what to do."""


_python_showwarning = warnings.showwarning


def show_warning(message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ANN001 - warnings' signature
    """``warnings.showwarning`` for eyas's commands: an :class:`EyasWarning` as one line, ``warning:
    ...``, written above any progress bar (Python's file, line and calling source line are for the
    code's authors, not its users); other packages' warnings as Python shows them."""
    if not issubclass(category, EyasWarning):
        _python_showwarning(message, category, filename, lineno, file, line)
        return
    from tqdm import tqdm

    tqdm.write(f"warning: {message}", file=file or sys.stderr)
