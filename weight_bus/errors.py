"""The weight bus's errors (no heavy imports: the engine client and the job driver use them too)."""


class BusError(RuntimeError):
    """An engine refused a weight-bus call, or no update group could be built; the message names the
    engine. The caller must not publish the version."""


class Refused(BusError):
    """An engine answered, but not with success (HTTP status other than 200 or success: false)."""
