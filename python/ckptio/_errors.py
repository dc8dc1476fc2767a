"""Exceptions of ckptio: one per status code of the C++ core.

Every exception is a ``ckptio.Error`` carrying ``code`` (the C++ code's name,
"DATA_LOSS", ...); those a Python program expects to catch by their usual
type are also that type: bad arguments are ``ValueError``, a wait past its
deadline is ``TimeoutError``, a missing store or step ``FileNotFoundError``,
a refused access ``PermissionError``.
"""


class Error(Exception):
    """A ckptio call failed; ``code`` names the C++ status code."""

    code = "UNKNOWN"

    def __init__(self, message, code=None):
        super().__init__(message)
        if code is not None:
            self.code = code


class InvalidArgumentError(Error, ValueError):
    """Something passed was malformed or does not fit the step; do not retry."""
    code = "INVALID_ARGUMENT"


class NotFoundError(Error, FileNotFoundError):
    """The store, step or object does not exist."""
    code = "NOT_FOUND"


class AlreadyExistsError(Error, FileExistsError):
    """The step is already committed: committed steps are immutable."""
    code = "ALREADY_EXISTS"


class PermissionDeniedError(Error, PermissionError):
    """The OS refused access."""
    code = "PERMISSION_DENIED"


class FailedPreconditionError(Error):
    """The store's state forbids the call (another writer holds the lock, ...)."""
    code = "FAILED_PRECONDITION"


class AbortedError(Error):
    """A concurrency conflict: this writer was fenced by a newer one."""
    code = "ABORTED"


class WriterDiedError(AbortedError):
    """A waiting rank saw rank 0 die before it committed; the newest
    committed step is intact: relaunch the job to resume from it."""


class UnavailableError(Error, OSError):
    """A transient failure (an I/O error, a server gone); retrying the whole
    call may help."""
    code = "UNAVAILABLE"


class DataLossError(Error):
    """Bytes on storage do not match their checksum, or a file is torn: the
    data is not usable."""
    code = "DATA_LOSS"


class ResourceExhaustedError(Error, OSError):
    """Out of space, quota, descriptors or memory."""
    code = "RESOURCE_EXHAUSTED"


class DeadlineExceededError(Error, TimeoutError):
    """A wait ran past its deadline (the Checkpointer's timeout)."""
    code = "DEADLINE_EXCEEDED"


class UnimplementedError(Error, NotImplementedError):
    """The backend does not support the operation."""
    code = "UNIMPLEMENTED"


class InternalError(Error):
    """A bug, or an errno with no better mapping: please report it."""
    code = "INTERNAL"


_BY_CODE = {cls.code: cls for cls in (
    InvalidArgumentError, NotFoundError, AlreadyExistsError, PermissionDeniedError,
    FailedPreconditionError, AbortedError, UnavailableError, DataLossError,
    ResourceExhaustedError, DeadlineExceededError, UnimplementedError, InternalError)}


def raise_status(code, message, writer_died=False):
    """Raises the exception for a failed C++ status (called by _ckptio)."""
    cls = WriterDiedError if writer_died else _BY_CODE.get(code, Error)
    raise cls(message, code)
