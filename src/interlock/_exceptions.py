"""The exception tree: expected refusals are InterlockError, bugs are InternalError."""

from __future__ import annotations


class InterlockError(Exception):
    """Something interlock refused, by design."""


class MachineDefinitionError(InterlockError, ValueError):
    """A machine definition is inconsistent; raised when it is compiled."""


class ToolDefinitionError(InterlockError, ValueError):
    """A tool definition is inconsistent; raised when it is compiled."""


class ProtocolError(InterlockError):
    """An undecodable or out-of-order message between an actor and the supervisor."""


class RunNotFound(InterlockError, LookupError):
    """No run with this id exists in the store."""

    def __init__(self, run_id: str) -> None:
        super().__init__(f"run {run_id!r} not found")
        self.run_id = run_id


class ProviderError(InterlockError):
    """Raise from a provider for a failure to answer (not a bad answer).

    Any exception a provider raises is a provider failure: journaled, retried under the
    machine's :class:`ProviderPolicy`, never counted as the model's mistake. This one
    says more: whether retrying can help and how long the provider asked us to wait.

    Args:
      message: what failed (never include an API key).
      retryable: False for a failure that retrying cannot fix (a bad API key, a model
        that does not exist): the run escalates with ``provider_unavailable`` at once.
      retry_after: seconds the provider asked us to wait (Retry-After), if it said.
      status: the HTTP status, if there was one.
    """

    def __init__(
        self,
        message: str,
        *,
        retryable: bool = True,
        retry_after: float | None = None,
        status: int | None = None,
    ) -> None:
        super().__init__(message)
        self.retryable = retryable
        self.retry_after = retry_after
        self.status = status


class StoreError(InterlockError):
    """The store cannot be opened, read or written (corrupt file, torn journal, lost connection)."""


class JournalCorrupt(StoreError):
    """A journal frame failed its length or checksum check."""


class IndexDamaged(StoreError):
    """The runs index is damaged: a row fails its checksum or disagrees with its run's
    journal, or rows are missing.

    The index is derived from the journal, so the journal may well be intact; but no
    answer built on the damaged index is given.

    Attributes:
      run_id: the run the damaged row names (as stored, so itself possibly damaged), or
        None when the damage is not one row's (rows are missing).
    """

    def __init__(self, run_id: str | None, what: str) -> None:
        where = "runs index" if run_id is None else f"runs index row of run {run_id!r}"
        super().__init__(
            f"{where} is damaged ({what}); the store was written outside interlock or its "
            "file is damaged; restore it from a backup"
        )
        self.run_id = run_id


class LeaseLost(StoreError):
    """Another worker took over a run this worker had leased."""


class ReplayDivergence(InterlockError):
    """A replayed run decided differently from its recording.

    Attributes:
      seq: the first journal sequence number where the two differ.
      expected: what the recording holds there.
      got: what the replay produced.
    """

    def __init__(self, run_id: str, seq: int, expected: str, got: str) -> None:
        super().__init__(f"run {run_id!r} diverged at seq {seq}: expected {expected}, got {got}")
        self.run_id = run_id
        self.seq = seq
        self.expected = expected
        self.got = got


class InternalError(Exception):
    """A bug in interlock. Deliberately outside the InterlockError tree."""
