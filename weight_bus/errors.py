"""The weight bus's errors (no heavy imports: the engine client and the job driver use them too)."""

from concurrent.futures import Future


class BusError(RuntimeError):
    """An engine refused a weight-bus call, or no update group could be built; the message names the
    engine. The caller must not publish the version."""


class Refused(BusError):
    """An engine answered, but not with success (HTTP status other than 200 or success: false)."""


class UpdateFailed(Exception):
    """A bucket was not confirmed: engine calls that failed, and the collective's error if any."""

    def __init__(self, bucket, errors: dict[str, BaseException], collective: BaseException | None):
        self.bucket, self.errors, self.collective = bucket, errors, collective
        parts = [f"{url}: {e}" for url, e in errors.items()]
        if collective is not None:
            parts.append(f"collective: {collective}")
        super().__init__(f"bucket {bucket.index}: " + "; ".join(parts))


def _error(f: Future) -> BaseException | None:
    """The exception of a finished call (a cancelled one counts as failed); None while running or on success."""
    if not f.done():
        return None
    if f.cancelled():
        return RuntimeError("cancelled")
    return f.exception()
